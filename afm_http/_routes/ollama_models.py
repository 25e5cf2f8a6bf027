"""Ollama's model routes: ``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``,
``GET /api/version``.

The shapes are :mod:`afm_core.api.ollama`'s; this module gathers what they
say from the served models (:mod:`afm_http._registry`) and their files,
without loading a model: a model's ``config.json`` (its ``model_type`` is the
``family``; ``quantization`` or ``torch_dtype`` the ``quantization_level``;
the weights' bytes over the bits per weight its ``parameter_size``), its
tokenizer's chat template (what ``template`` shows: Jinja, not an Ollama Go
template), and its engine once loaded (the context, the thinking and tool
capabilities).  A GGUF file that was not loaded yet says only what its name
and size do.  The ``digest`` names the files (their path, size and time),
not their content: afm does not hash weights to list them.
``/api/ps`` lists the loaded models with ``expires_at``, when their
keep-alive unloads them (``--keep-alive``, the requests' ``keep_alive``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import trio
from quart import Response

from afm_core import Engine, RequestError, __version__
from afm_core.api import ollama

from .._asgi import AFMQuart
from .._json import json_response
from .._registry import ModelSpec, weights_bytes
from .._request import read_json
from .._residency import FOREVER
from .._state import AppState, current_state

__all__ = ["register"]

FOREVER_SECONDS = (2**63 - 1) / 1e9
"""How far ``expires_at`` is for a model kept forever (Go's longest duration, as Ollama says it)."""
_GGUF_QUANT = re.compile(r"(?i)(iq\d_\w+|q\d+_k_[sml]|q\d+_k|q\d+_\d|bf16|f16|f32)")


def register(app: AFMQuart) -> None:
    app.get("/api/tags")(ollama_tags)
    app.post("/api/show")(ollama_show)
    app.get("/api/ps")(ollama_ps)
    app.get("/api/version")(ollama_version)


def _json_file(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _parameter_size(weights: int, bits_per_weight: float) -> str:
    """Ollama's way of writing a parameter count: ``494.03M``, ``1.5B``, ``24.58K``."""
    params = weights * 8 / bits_per_weight if weights and bits_per_weight else 0
    if params >= 1e9:
        return f"{params / 1e9:.1f}B"
    if params >= 1e6:
        return f"{params / 1e6:.2f}M"
    return f"{params / 1e3:.2f}K" if params else ""


def _from_config(directory: Path) -> dict[str, Any]:
    """The facts an mlx-lm directory's files give."""
    config = _json_file(directory / "config.json")
    quant = config.get("quantization") if isinstance(config.get("quantization"), dict) else None
    dtype = str(config.get("torch_dtype") or "float16")
    if quant and isinstance(quant.get("bits"), int):
        bits, group = quant["bits"], quant.get("group_size") or 64
        level, bpw = f"Q{bits}", bits + 32 / group  # a float16 scale and bias per group
    else:
        level = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype, dtype.upper())
        bpw = 32 if dtype == "float32" else 16
    template = _json_file(directory / "tokenizer_config.json").get("chat_template") or ""
    return {"format": "safetensors", "family": str(config.get("model_type") or ""),
            "quantization_level": level,
            "parameter_size": _parameter_size(weights_bytes(directory), bpw),
            "context_length": config.get("max_position_embeddings"),
            "embedding_length": config.get("hidden_size"),
            "template": template if isinstance(template, str) else ""}


def _facts(spec: ModelSpec, engine: Engine | None) -> ollama.ModelFacts:
    """What the model routes say about one model (its files read, never loaded)."""
    source = Path(spec.source).expanduser()
    try:
        mtime = source.stat().st_mtime
    except OSError:
        mtime = 0.0
    digest = hashlib.sha256(f"{source}\0{spec.size}\0{mtime}".encode()).hexdigest()
    found: dict[str, Any] = {}
    directory = engine.model_path if engine is not None else source
    if directory.is_dir():
        found = _from_config(directory)
    if source.suffix.lower() == ".gguf":
        quant = _GGUF_QUANT.search(source.stem)
        found.update(format="gguf", quantization_level=quant.group(1).upper() if quant else "")
    capabilities = ["completion"]
    if engine is not None and engine.info is not None:
        found["context_length"] = engine.context_length
        found["template"] = engine.info.chat_template
        if engine.info.tool_format:
            capabilities.append("tools")
        if engine.info.think_tags:
            capabilities.append("thinking")
    elif "tools" in found.get("template", ""):
        capabilities.append("tools")
    found = {k: v for k, v in found.items() if v is not None}
    return ollama.ModelFacts(name=spec.id, size=spec.size, modified_at=mtime, digest=digest,
                             capabilities=tuple(capabilities), **found)


async def _all_facts(state: AppState) -> list[tuple[ollama.ModelFacts, Engine | None]]:
    registry = state.models
    specs = registry.specs()
    engines = [registry.engine_of(s.id) for s in specs]
    facts = await trio.to_thread.run_sync(lambda: [_facts(s, e) for s, e in zip(specs, engines,
                                                                                 strict=True)])
    return list(zip(facts, engines, strict=True))


async def ollama_tags() -> Response:
    return json_response(ollama.tags_response([f for f, _ in await _all_facts(current_state())]))


async def ollama_show() -> Response:
    state = current_state()
    body = await read_json()
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name:
        raise RequestError("model is required", param="model")
    try:
        model_id = state.models.resolve(name)
    except RequestError:
        raise RequestError(f"model '{name}' not found", param="model", status=404) from None
    spec = next(s for s in state.models.specs() if s.id == model_id)
    facts = await trio.to_thread.run_sync(_facts, spec, state.models.engine_of(model_id))
    return json_response(ollama.show_response(facts))


async def ollama_ps() -> Response:
    state = current_state()
    now, wall = trio.current_time(), time.time()
    rows = {row.id: row for row, _ in state.models.rows()}
    vram = sys.platform == "darwin"  # unified memory: what is loaded is the GPU's
    loaded = []
    for facts, engine in await _all_facts(state):
        if engine is None:
            continue
        row = rows[facts.name]
        if row.expires is not None:
            expires = wall + (row.expires - now)
        elif row.keep_alive == FOREVER or not math.isfinite(row.keep_alive):
            expires = wall + FOREVER_SECONDS
        else:  # busy now: its keep-alive starts when its requests end
            expires = wall + row.keep_alive
        loaded.append((facts, expires, row.size if vram else 0))
    return json_response(ollama.ps_response(loaded))


async def ollama_version() -> Response:
    return json_response(ollama.version_response(__version__))
