"""Start and stop the servers under test as loopback subprocesses.

``serving(spec, ...)`` is an async context manager: it picks a free port on
127.0.0.1, starts the process with its output in a log file, waits for
``GET /health`` (bounded), yields the base URL, and on exit terminates the
process (then kills it if it has not exited within a grace period).  Only
processes started here are ever signalled.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from ._errors import ServerStartError

HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to launch one kind of server; ``model_field`` is the request's
    ``model`` value for it (None omits the field)."""

    name: str
    argv: tuple[str, ...]
    model_field: str | None = None
    health_path: str = "/health"
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables set for the process on top of this one's."""


def free_port() -> int:
    """A currently unused TCP port on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def ours_available() -> bool:
    """Whether ``afm serve`` (the ``afm_http`` server) is importable."""
    try:
        return importlib.util.find_spec("afm_http._serve_cli") is not None
    except (ImportError, ValueError):
        return False


def ours_spec(model_dir: str | Path | None, port: int, *, max_batch: int | None = None,
              extra: tuple[str, ...] = (), name: str = "ours",
              env: tuple[tuple[str, str], ...] = ()) -> ServerSpec:
    """``afm serve --model DIR --host 127.0.0.1 --port P --quiet`` (no access
    log, like the peer at ``--log-level WARNING``); without ``model_dir``
    the default model (no ``--model``)."""
    argv: tuple[str, ...] = (sys.executable, "-m", "afm_core._cli", "serve")
    if model_dir is not None:
        argv += ("--model", str(model_dir))
    argv += ("--host", HOST, "--port", str(port), "--quiet")
    if max_batch is not None:
        argv += ("--max-batch", str(max_batch))
    return ServerSpec(name, argv + extra, model_field=None, env=env)


#: The line the peer's launcher prints with its BLAS (``BLAS_MARK {json}``).
BLAS_MARK = "afm-bench-blas:"

# Runs ``mlx_lm.server`` as ``python -m`` would, after binding MLX's products to
# the same BLAS as afm (``afm_core._mlx.blas``, before anything imports mlx.core),
# and prints which BLAS that is.  Without ``afm_core._mlx.blas`` it runs the server
# unchanged (MLX's own BLAS).
_PEER_LAUNCHER = f"""\
import json, runpy, sys
try:
    import afm_core._mlx.blas as b
except ImportError:
    info = {{"name": "reference", "reason": "afm_core._mlx.blas not available"}}
else:
    b.ensure_loaded()
    info = b.confirm().as_dict()
print({BLAS_MARK!r}, json.dumps(info), flush=True)
sys.argv = ["mlx_lm.server", *sys.argv[1:]]
runpy.run_module("mlx_lm.server", run_name="__main__", alter_sys=True)
"""


def peer_spec(model_dir: str | Path, port: int, *, decode_concurrency: int | None = None,
              extra: tuple[str, ...] = ()) -> ServerSpec:
    """``mlx_lm.server`` on the same model (through a launcher that gives it
    afm's BLAS; see ``_PEER_LAUNCHER``); its ``model`` field must be omitted
    or equal the local path, so we omit it."""
    argv: tuple[str, ...] = (sys.executable, "-c", _PEER_LAUNCHER, "--model", str(model_dir),
                             "--host", HOST, "--port", str(port), "--log-level", "WARNING")
    if decode_concurrency is not None:
        argv += ("--decode-concurrency", str(decode_concurrency))
    return ServerSpec("mlx_lm.server", argv + extra, model_field=None)


def peak_rss_bytes(pid: int) -> dict[str, int] | None:
    """``VmHWM`` (peak resident set) and ``VmRSS`` of a live process, in bytes
    (Linux ``/proc``); None when they cannot be read."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            parts = value.split()
            if parts and parts[0].isdigit():
                out["peak" if key == "VmHWM" else "current"] = int(parts[0]) * 1024
    return out if "peak" in out else None


def blas_from_log(log_path: Path) -> dict[str, object] | None:
    """The BLAS the peer's launcher printed into its log, if it did."""
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if line.startswith(BLAS_MARK):
                    value = json.loads(line[len(BLAS_MARK):])
                    return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None
    return None


# ASYNC109: the deadline is part of the poll, not a cancel scope: on expiry the
# caller gets a ServerStartError carrying the server's log tail.
async def wait_healthy(base_url: str, proc: subprocess.Popen[bytes], *, timeout: float,  # noqa: ASYNC109
                       log_path: Path, path: str = "/health") -> None:
    """Poll ``path`` (``/health``) until 200, the process exits, or ``timeout``."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        while True:
            if proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with {proc.returncode}; log tail:\n{_tail(log_path)}")
            try:
                resp = await client.get(base_url + path)
                if resp.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"not healthy after {timeout:g} s; log tail:\n{_tail(log_path)}")
            await trio.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> int:
    """SIGTERM (then SIGINT, then SIGKILL) this process and reap it."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        if proc.poll() is not None:
            break
        try:
            proc.send_signal(sig)
            proc.wait(timeout=grace / 2)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=grace)
    return int(proc.returncode)


@dataclass(frozen=True, slots=True)
class Running:
    """A started server: where it listens, its process id and its log."""

    base_url: str
    pid: int
    log_path: Path


@asynccontextmanager
async def serving(spec: ServerSpec, port: int, log_dir: Path, *,
                  startup_timeout: float = 180.0) -> AsyncIterator[str]:
    """Run ``spec`` for the duration of the block; yields its base URL."""
    async with serving_process(spec, port, log_dir, startup_timeout=startup_timeout) as running:
        yield running.base_url


@asynccontextmanager
async def serving_process(spec: ServerSpec, port: int, log_dir: Path, *,
                          startup_timeout: float = 180.0) -> AsyncIterator[Running]:
    """``serving``, yielding the process id and log path besides the URL."""
    # ASYNC220/230/240: the launch stays synchronous on purpose.  It runs once, before
    # any load, and blocks only for a moment; and with no checkpoint between starting
    # the child and the try/finally below, a cancellation cannot leak the process.
    log_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in spec.name)
    log_path = log_dir / f"{safe}-{port}.log"
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(spec.env)
    with open(log_path, "wb") as log:  # noqa: ASYNC230
        proc = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT,  # noqa: ASYNC220
                                stdin=subprocess.DEVNULL, env=env)
    base_url = f"http://{HOST}:{port}"
    try:
        await wait_healthy(base_url, proc, timeout=startup_timeout, log_path=log_path,
                           path=spec.health_path)
        yield Running(base_url, proc.pid, log_path)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(stop, proc)


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
