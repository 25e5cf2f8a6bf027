"""The models people already have: Ollama's, LM Studio's and the Hugging Face cache.

Read-only, offline, filesystem only:

* **Ollama** (``$OLLAMA_MODELS``, else ``~/.ollama/models``): a name
  ``[registry/][namespace/]model[:tag]`` (defaults ``registry.ollama.ai``,
  ``library``, ``latest``) has a manifest at
  ``manifests/<registry>/<namespace>/<model>/<tag>``; its layer of media type
  ``application/vnd.ollama.image.model`` is the GGUF file, stored as
  ``blobs/sha256-<hex>``.  The ``params`` (JSON) and ``template`` (Go
  template) layers are read and reported, not applied: afm renders the GGUF's
  own Jinja chat template (Ollama's Go template is a port of it) and takes
  sampling settings from each request;
* **LM Studio** (``~/.lmstudio/models``, or the older
  ``~/.cache/lm-studio/models``): ``publisher/repo`` folders holding GGUF
  files (``publisher/repo/file.gguf`` names one) or an MLX model;
* **Hugging Face cache** (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``): ``models--org--name/snapshots/<revision>``,
  the revision ``refs/main`` points at (else the newest), an MLX model
  directory (mlx-community's) or a GGUF repository.

:func:`local_models` lists them (``afm models``); :func:`find_in_stores`
turns a ``--model`` name into a file or directory for
:func:`afm_core._models.resolve.resolve_model`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .._errors import ModelLoadError

__all__ = [
    "LocalModel",
    "find_in_stores",
    "find_local_model",
    "gguf_summary",
    "hf_cache_root",
    "lmstudio_roots",
    "local_models",
    "ollama_model",
    "ollama_root",
]

OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_PARAMS = "application/vnd.ollama.image.params"
OLLAMA_TEMPLATE = "application/vnd.ollama.image.template"
OLLAMA_REGISTRY = "registry.ollama.ai"


@dataclass(frozen=True)
class LocalModel:
    """One model found in a local store."""

    name: str  # what --model takes: "ollama:qwen2.5-coder:0.5b", "lmstudio:pub/repo/f.gguf", "hf:org/name"
    store: str  # "ollama", "lmstudio", "huggingface"
    path: Path  # the GGUF file or the model directory
    format: str  # "gguf" or "mlx"
    size: int  # bytes on disk
    quantization: str | None = None  # "Q4_K_M", "4-bit (group 64)", "bfloat16", ...
    architecture: str | None = None
    details: dict[str, Any] = field(default_factory=dict)  # Ollama's params / template

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "store": self.store, "path": str(self.path), "format": self.format,
                "size": self.size, "quantization": self.quantization,
                "architecture": self.architecture, **self.details}  # fmt: skip


# --- GGUF headers ------------------------------------------------------------------

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _skip_value(f: BinaryIO, vtype: int) -> None:
    if vtype == 8:
        f.seek(_read(f, "<Q"), os.SEEK_CUR)
    elif vtype == 9:
        etype, count = _read(f, "<I"), _read(f, "<Q")
        if etype in _SCALAR:
            f.seek(struct.calcsize(_SCALAR[etype]) * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, etype)
    elif vtype in _SCALAR:
        f.seek(struct.calcsize(_SCALAR[vtype]), os.SEEK_CUR)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


def gguf_summary(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``general.architecture``, ``general.name``, ``general.file_type`` (as
    llama.cpp's name, e.g. ``Q4_K_M``) and whether a chat template is there,
    read from the header without the vocabulary arrays; ``{}`` if unreadable."""
    wanted = {"general.architecture", "general.name", "general.file_type"}
    out: dict[str, Any] = {}
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return {}
            _read(f, "<I")
            _read(f, "<Q")
            for _ in range(_read(f, "<Q")):
                key = f.read(_read(f, "<Q")).decode("utf-8", "replace")
                vtype = _read(f, "<I")
                if key in wanted and vtype == 8:
                    out[key] = f.read(_read(f, "<Q")).decode("utf-8", "replace")
                elif key in wanted and vtype in _SCALAR:
                    out[key] = _read(f, _SCALAR[vtype])
                else:
                    if key == "tokenizer.chat_template":
                        out["chat_template"] = True
                    _skip_value(f, vtype)
    except (OSError, ValueError, struct.error):
        return out
    if "general.file_type" in out:
        out["quantization"] = _file_type_name(int(out["general.file_type"]))
    return out


def _file_type_name(value: int) -> str:
    import gguf

    try:
        name = gguf.LlamaFileType(value).name
    except ValueError:
        return f"file type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _gguf_model(name: str, store: str, path: Path, size: int | None = None,
                details: dict[str, Any] | None = None) -> LocalModel:
    info = gguf_summary(path)
    return LocalModel(name=name, store=store, path=path, format="gguf",
                      size=path.stat().st_size if size is None else size,
                      quantization=info.get("quantization"),
                      architecture=info.get("general.architecture"), details=details or {})  # fmt: skip


def _mlx_model(name: str, store: str, path: Path) -> LocalModel:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    quant = config.get("quantization") or config.get("quantization_config") or {}
    if isinstance(quant, dict) and quant.get("bits"):
        label = f"{quant['bits']}-bit (group {quant.get('group_size', 64)})"
    else:
        label = config.get("torch_dtype") or config.get("dtype")
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file() and p.suffix == ".safetensors")
    return LocalModel(name=name, store=store, path=path, format="mlx", size=size, quantization=label,
                      architecture=config.get("model_type"))


def _is_mlx_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


# --- Ollama --------------------------------------------------------------------------


def ollama_root() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def _ollama_parts(name: str) -> tuple[str, str, str, str]:
    """``(registry, namespace, model, tag)`` of an Ollama model name."""
    base, tag = name, "latest"
    head, colon, tail = name.rpartition(":")
    if colon and "/" not in tail:
        base, tag = head, tail
    parts = base.split("/")
    if len(parts) == 1:
        parts = [OLLAMA_REGISTRY, "library", parts[0]]
    elif len(parts) == 2:
        parts = [OLLAMA_REGISTRY, *parts]
    if len(parts) != 3 or not all(parts) or not tag:
        raise ModelLoadError(f"{name!r} is not an Ollama model name ([registry/][namespace/]model[:tag])")
    return parts[0], parts[1], parts[2], tag


def _short_name(registry: str, namespace: str, model: str, tag: str) -> str:
    if registry == OLLAMA_REGISTRY:
        return f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
    return f"{registry}/{namespace}/{model}:{tag}"


def _blob(root: Path, digest: str) -> Path:
    return root / "blobs" / digest.replace(":", "-")


def ollama_model(name: str, root: Path | None = None) -> LocalModel:
    """The Ollama model ``name`` (see the module docstring); :class:`ModelLoadError`
    for a missing name, a manifest without a model layer or a missing blob."""
    root = root or ollama_root()
    registry, namespace, model, tag = _ollama_parts(name)
    manifest = root / "manifests" / registry / namespace / model / tag
    short = _short_name(registry, namespace, model, tag)
    if not manifest.is_file():
        have = [m.name.removeprefix("ollama:") for m in _ollama_models(root)]
        hint = f"; Ollama has: {', '.join(have)}" if have else f" (no Ollama models under {root})"
        raise ModelLoadError(f"Ollama model {short!r} not found: no manifest {manifest}{hint}")
    try:
        layers = json.loads(manifest.read_text()).get("layers") or []
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Ollama manifest {manifest} is unreadable: {exc}") from exc
    by_type = {layer.get("mediaType"): layer for layer in layers if isinstance(layer, dict)}
    if OLLAMA_MODEL not in by_type:
        raise ModelLoadError(f"Ollama manifest {manifest} has no model layer ({OLLAMA_MODEL}): "
                             "nothing to load")
    blob = _blob(root, str(by_type[OLLAMA_MODEL].get("digest", "")))
    if not blob.is_file():
        raise ModelLoadError(f"the model blob of Ollama model {short!r} is missing: {blob} "
                             f"(run `ollama pull {short}` again)")
    details: dict[str, Any] = {}
    for key, media in (("params", OLLAMA_PARAMS), ("template", OLLAMA_TEMPLATE)):
        layer = by_type.get(media)
        path = _blob(root, str(layer.get("digest", ""))) if layer else None
        if path is not None and path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            try:
                details[key] = json.loads(text) if key == "params" else text
            except ValueError:
                details[key] = text
    return _gguf_model(f"ollama:{short}", "ollama", blob, details=details)


def _ollama_models(root: Path) -> Iterator[LocalModel]:
    base = root / "manifests"
    if not base.is_dir():
        return
    for manifest in sorted(p for p in base.glob("*/*/*/*") if p.is_file()):
        registry, namespace, model, tag = manifest.relative_to(base).parts
        try:
            yield ollama_model(f"{registry}/{namespace}/{model}:{tag}", root)
        except ModelLoadError:
            continue


# --- LM Studio -------------------------------------------------------------------------


def lmstudio_roots() -> list[Path]:
    home = Path.home()
    return [p for p in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models") if p.is_dir()]


def _lmstudio_entry(root: Path, rel: str) -> LocalModel | None:
    path = root / rel
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_model(f"lmstudio:{rel}", "lmstudio", path)
    if path.is_dir() and _is_mlx_dir(path):
        return _mlx_model(f"lmstudio:{rel}", "lmstudio", path)
    if path.is_dir():
        ggufs = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
        if len(ggufs) == 1:
            return _gguf_model(f"lmstudio:{rel}", "lmstudio", ggufs[0])
        if ggufs:
            names = ", ".join(f"{rel}/{p.name}" for p in ggufs)
            raise ModelLoadError(f"LM Studio folder {path} holds several GGUF files: name one of {names}")
    return None


def _lmstudio_models(root: Path) -> Iterator[LocalModel]:
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
        rel = folder.relative_to(root).as_posix()
        if _is_mlx_dir(folder):
            yield _mlx_model(f"lmstudio:{rel}", "lmstudio", folder)
        for gguf_file in sorted(folder.glob("*.gguf")):
            if not gguf_file.name.startswith("mmproj"):
                yield _gguf_model(f"lmstudio:{rel}/{gguf_file.name}", "lmstudio", gguf_file)


# --- the Hugging Face cache ---------------------------------------------------------------


def hf_cache_root() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _snapshot(repo_dir: Path) -> Path | None:
    snaps = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        rev = snaps / ref.read_text().strip()
        if rev.is_dir():
            return rev
    found = sorted((p for p in snaps.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime) \
        if snaps.is_dir() else []
    return found[-1] if found else None


def _hf_entry(root: Path, repo: str) -> LocalModel | None:
    snap = _snapshot(root / ("models--" + repo.replace("/", "--")))
    if snap is None:
        return None
    if _is_mlx_dir(snap):
        return _mlx_model(f"hf:{repo}", "huggingface", snap)
    ggufs = sorted(p for p in snap.glob("*.gguf") if not p.name.startswith("mmproj"))
    if len(ggufs) == 1:
        return _gguf_model(f"hf:{repo}", "huggingface", ggufs[0])
    return None


def _hf_models(root: Path) -> Iterator[LocalModel]:
    for repo_dir in sorted(root.glob("models--*--*")):
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        entry = _hf_entry(root, repo)
        if entry is not None:
            yield entry


# --- listing and lookup ---------------------------------------------------------------------


def local_models(root: str | os.PathLike[str] | None = None) -> list[LocalModel]:
    """Every model in the local stores (``root``: one store's root folder, of any kind)."""
    if root is not None:
        path = Path(root).expanduser()
        if (path / "manifests").is_dir() and (path / "blobs").is_dir():
            return list(_ollama_models(path))
        if any(path.glob("models--*--*")):
            return list(_hf_models(path))
        return list(_lmstudio_models(path))
    found = list(_ollama_models(ollama_root()))
    for lms in lmstudio_roots():
        found.extend(_lmstudio_models(lms))
    hub = hf_cache_root()
    if hub.is_dir():
        found.extend(_hf_models(hub))
    return found


def find_local_model(spec: str) -> LocalModel | None:
    """The store model a name stands for (its file or directory, and for an
    Ollama model its ``params`` / ``template`` layers in ``details``), else None.

    ``ollama:NAME`` / ``lmstudio:PUB/REPO[/FILE]`` / ``hf:ORG/NAME`` name a
    store (errors are :class:`ModelLoadError`); a bare ``org/name`` is looked
    up in the Hugging Face cache, then LM Studio; a bare ``name:tag`` (or a
    ``name`` Ollama has as ``name:latest``) in Ollama.
    """
    kind, colon, rest = spec.partition(":")
    if colon and kind == "ollama":
        return ollama_model(rest)
    if colon and kind == "lmstudio":
        for root in lmstudio_roots():
            entry = _lmstudio_entry(root, rest)
            if entry is not None:
                return entry
        raise ModelLoadError(f"LM Studio model {rest!r} not found under "
                             f"{' or '.join(map(str, lmstudio_roots())) or '~/.lmstudio/models'}")
    if colon and kind == "hf":
        entry = _hf_entry(hf_cache_root(), rest)
        if entry is None:
            raise ModelLoadError(f"{rest!r} is not in the Hugging Face cache {hf_cache_root()} "
                                 "(an MLX model directory or a single-GGUF repository)")
        return entry
    if ":" not in spec and (spec.count("/") == 1 or (spec.count("/") == 2 and spec.endswith(".gguf"))):
        entry = _hf_entry(hf_cache_root(), spec) if spec.count("/") == 1 else None
        for root in lmstudio_roots():
            entry = entry or _lmstudio_entry(root, spec)
        return entry
    if spec.startswith((".", "/", "~")) or "/" in spec.rpartition(":")[2]:
        return None
    if ":" in spec:
        return ollama_model(spec)  # a name:tag is Ollama's: its error is the clear one
    try:
        return ollama_model(spec)
    except ModelLoadError:
        return None


def find_in_stores(spec: str) -> Path | None:
    """The file or directory a store name stands for, else None (see :func:`find_local_model`)."""
    found = find_local_model(spec)
    return found.path if found is not None else None
