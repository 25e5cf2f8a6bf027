"""The targets of ``afm bench --real-model``: starting each, driving a level, what it runs on.

Target keys (``--targets``) and their names in the report:

=============  ================  ==================================================
key            name              what
=============  ================  ==================================================
``ours``       ours              ``afm serve`` on the model, its best kernels
``ours_avx2``  ours-avx2         the same with ``AFM_QMM_ISA=avx2`` and
                                 ``OPENBLAS_CORETYPE=Haswell``: the kernels most
                                 users' x86 CPUs run (``--afm-isa`` picks another)
``llamacpp``   llama.cpp         llama.cpp's own server loop (xllamacpp), 8 slots
``llamacpp_py``llama-cpp-python  ``llama_cpp.server``, one request at a time
                                 (single-stream phases only)
``raw``        raw               mlx-lm's ``BatchGenerator`` in this process
``raw_kernels``raw+kernels       the same with afm's CPU kernels
``peer``       mlx_lm.server     mlx-lm's own server
=============  ================  ==================================================

Every afm server runs with its prefix cache off (``--prefix-cache-bytes 0``),
plain decoding (``--prompt-lookup 0``: prompt lookup, on by default for
models of 256 MiB or more, is measured against llama.cpp by ``afm bench
--speculation``, on workloads made for it) and ``--max-batch`` the 8-stream
phase's width; llama.cpp's caches are off as
``_llamacpp`` says.  :func:`open_target` starts one (or loads raw), and
returns an :class:`Opened` whose ``drive`` runs one level; ``probe_info``
reads what the target computes with (kernel ISA, BLAS, threads) once it ran.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from . import _llamacpp, _loadgen, _servers
from ._raw import RawRunner
from ._real_models import ModelSpec
from ._report import OURS, PEER, RAW, RAW_KERNELS
from ._results import RunResult
from ._workload import Workload

__all__ = ["AFM_KEYS", "DEFAULT_REAL_TARGETS", "OURS_AVX2", "REAL_TARGETS", "SERIAL_KEYS",
           "TARGET_NAMES", "Opened", "TargetContext", "open_target", "probe_info", "unavailable"]

OURS_AVX2 = "ours-avx2"
REAL_TARGETS = ("ours", "ours_avx2", "llamacpp", "llamacpp_py", "raw", "raw_kernels", "peer")
DEFAULT_REAL_TARGETS = ("ours", "ours_avx2", "llamacpp")
TARGET_NAMES = {"ours": OURS, "ours_avx2": OURS_AVX2, "llamacpp": _llamacpp.LLAMACPP,
                "llamacpp_py": _llamacpp.LLAMACPP_PY, "raw": RAW, "raw_kernels": RAW_KERNELS,
                "peer": PEER}
AFM_KEYS = frozenset({"ours", "ours_avx2", "raw", "raw_kernels", "peer"})
"""Targets that need afm's conversion of the model."""
SERIAL_KEYS = frozenset({"llamacpp_py"})
"""Targets that serve one request at a time: they skip the 8-stream phase."""

Drive = Callable[[Workload, int, int, int, float, float], Awaitable[RunResult]]
"""(workload, concurrency, first index, requests, level timeout, request timeout) -> run"""


@dataclass(slots=True)
class TargetContext:
    """Settings shared by every target of one model's run."""

    log_dir: Path
    threads: int
    threads_explicit: bool = False
    max_batch: int = 8
    n_ctx: int = 4096
    afm_isa: str = "avx2"
    startup_timeout: float = 600.0
    serve_args: tuple[str, ...] = ()
    peer_args: tuple[str, ...] = ()
    llamacpp_py_args: tuple[str, ...] = ()
    llamacpp_settings: tuple[str, ...] = ()


@dataclass(slots=True)
class Opened:
    """A target ready to run levels."""

    key: str
    name: str
    pid: int
    drive: Drive
    info: dict[str, Any] = field(default_factory=dict)
    base_url: str | None = None


def _afm_isa_best() -> str | None:
    from afm_core import runtime_info

    return runtime_info().quantized_kernel


def unavailable(key: str, spec: ModelSpec, ctx: TargetContext) -> str | None:
    """Why target ``key`` cannot run on ``spec`` here, or None."""
    if key in AFM_KEYS and spec.afm_error:
        return spec.afm_error
    if key in ("ours", "ours_avx2") and not _servers.ours_available():
        return "afm serve is not available (afm_http._serve_cli not importable)"
    if key in ("raw", "raw_kernels", "peer") and spec.directory is None:
        return "needs afm's mlx-lm directory of the model"
    if key == "ours_avx2":
        best = _afm_isa_best()
        if best is None:
            return "afm's quantized kernels are not built (no ISA to force)"
        if best == ctx.afm_isa:
            return f"this CPU's best kernels are {best} already: ours is the {ctx.afm_isa} figure"
    if key in ("llamacpp", "llamacpp_py") and not spec.gguf:
        return "no GGUF file for llama.cpp (give --gguf FILE)"
    if key == "llamacpp":
        return _llamacpp.xllamacpp_unavailable()
    if key == "llamacpp_py":
        return _llamacpp.llamacpp_py_unavailable()
    return None


def _afm_env(key: str, ctx: TargetContext) -> tuple[tuple[str, str], ...]:
    env: list[tuple[str, str]] = []
    if ctx.threads_explicit:
        env += [("AFM_BLAS_THREADS", str(ctx.threads)), ("AFM_QMM_THREADS", str(ctx.threads))]
    if key == "ours_avx2":
        env += [("AFM_QMM_ISA", ctx.afm_isa)]
        if ctx.afm_isa.startswith("avx2"):
            env += [("OPENBLAS_CORETYPE", "Haswell")]
    return tuple(env)


def _spec_for(key: str, spec: ModelSpec, ctx: TargetContext, port: int, name: str,
              extra: tuple[str, ...]) -> _servers.ServerSpec:
    if key in ("ours", "ours_avx2"):
        args = ("--prefix-cache-bytes", "0", "--prompt-lookup", "0", *ctx.serve_args, *extra)
        return _servers.ours_spec(spec.afm_model, port, max_batch=ctx.max_batch, extra=args,
                                  name=name, env=_afm_env(key, ctx))
    if key == "peer":
        assert spec.directory is not None
        return _servers.peer_spec(spec.directory, port, decode_concurrency=ctx.max_batch,
                                  extra=(*ctx.peer_args, *extra))
    assert spec.gguf is not None
    if key == "llamacpp":
        return _llamacpp.xllamacpp_spec(spec.gguf, port, threads=ctx.threads, parallel=ctx.max_batch,
                                        n_ctx=ctx.n_ctx, settings=(*ctx.llamacpp_settings, *extra),
                                        name=name)
    return _llamacpp.llamacpp_py_spec(spec.gguf, port, threads=ctx.threads, n_ctx=ctx.n_ctx,
                                      extra=(*ctx.llamacpp_py_args, *extra))


async def open_target(key: str, spec: ModelSpec, ctx: TargetContext, stack: AsyncExitStack, *,
                      name: str | None = None, extra: tuple[str, ...] = (),
                      log: Callable[[str], None] = print, keep_text: bool = False) -> Opened:
    """Start (or load) target ``key`` for the duration of ``stack``; raises
    ``ServerStartError`` when a server does not come up.  ``extra``: more
    arguments for the server (``--set`` items for llama.cpp); ``keep_text``:
    keep every answer's text (served targets)."""
    name = name or TARGET_NAMES[key]
    if key in ("raw", "raw_kernels"):
        assert spec.directory is not None
        runner = RawRunner(spec.directory, kernels=key == "raw_kernels", name=name, api=spec.api)
        stack.push_async_callback(runner.aclose)
        log(f"loading {name} (in-process mlx-lm) from {spec.directory}")
        await runner.load()

        async def raw_level(wl: Workload, c: int, first: int, n: int, level_timeout: float,
                            request_timeout: float) -> RunResult:
            return await runner.run_closed(wl, c, n, level_timeout=level_timeout, first_index=first)

        return Opened(key, name, os.getpid(), raw_level,
                      info={"process": "this benchmark process (raw runs in it)"})
    port = _servers.free_port()
    server = _spec_for(key, spec, ctx, port, name, extra)
    env = " ".join(f"{k}={v}" for k, v in server.env)
    log(f"starting {name}: {env + ' ' if env else ''}"
        f"{' '.join(a if len(a) < 200 else '<launcher>' for a in server.argv)}")
    running = await stack.enter_async_context(_servers.serving_process(
        server, port, ctx.log_dir, startup_timeout=ctx.startup_timeout))
    stack.callback(log, f"stopped {name}")
    llama = key in ("llamacpp", "llamacpp_py")
    target = _loadgen.Target(name, running.base_url, model=server.model_field,
                             count_chunks=llama, api=spec.api, keep_text=keep_text,
                             extra=tuple(_llamacpp.REQUEST_EXTRA.items()) if llama else ())

    async def served_level(wl: Workload, c: int, first: int, n: int, level_timeout: float,
                           request_timeout: float) -> RunResult:
        return await _loadgen.run_closed(target, wl, c, n, level_timeout=level_timeout,
                                         request_timeout=request_timeout, first_index=first)

    info: dict[str, Any] = {"pid": running.pid, "log": str(running.log_path)}
    if server.env:
        info["env"] = dict(server.env)
    return Opened(key, name, running.pid, served_level, info=info, base_url=running.base_url)


async def _health(base_url: str) -> dict[str, Any]:
    try:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            resp = await client.get(base_url + "/health")
        value = resp.json()
    except (httpx.HTTPError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


async def probe_info(opened: Opened, threads: int) -> dict[str, Any]:
    """What the target computes with: ``isa`` (the quantized kernels' or
    ggml's instruction set), ``blas`` and ``threads``."""
    import trio

    key = opened.key
    if key in ("ours", "ours_avx2") and opened.base_url:
        health = await _health(opened.base_url)
        blas = health.get("blas") if isinstance(health.get("blas"), dict) else None
        return {"isa": health.get("quantized_kernel"), "blas": blas,
                "threads": (blas or {}).get("threads")}
    if key in ("raw", "raw_kernels"):
        from afm_core import runtime_info

        blas = runtime_info().blas
        return {"isa": _afm_isa_best() if key == "raw_kernels" else "mlx", "blas": blas,
                "threads": blas.get("threads")}
    if key == "peer":
        blas = _servers.blas_from_log(Path(opened.info["log"]))
        return {"isa": "mlx", "blas": blas, "threads": (blas or {}).get("threads")}
    if key == "llamacpp":
        launched = _llamacpp.launcher_info(Path(opened.info["log"])) or {}
        system = launched.get("system_info")
        return {"isa": _llamacpp.isa_summary(system), "blas": {"name": "ggml", "detail": system},
                "threads": threads, "xllamacpp": launched.get("version")}
    system = await trio.to_thread.run_sync(_llamacpp.llamacpp_py_system_info)
    return {"isa": _llamacpp.isa_summary(system), "blas": {"name": "ggml", "detail": system},
            "threads": threads}
