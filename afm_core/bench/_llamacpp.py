"""llama.cpp as the peer of ``afm bench --real-model``: how each server is launched.

Two peers, both on the same GGUF file as afm:

* ``llama.cpp`` (target ``llamacpp``, the baseline of every ratio):
  llama.cpp's own C++ server loop, ``server_context`` of ``llama-server``,
  through ``xllamacpp`` (a prebuilt llama.cpp on PyPI; no compiler needed),
  run by ``_llamacpp_launcher.py`` in a process of its own.  It batches:
  ``n_parallel`` slots (8, the width of the 8-stream phase) decode together,
  sharing one KV cache of ``n_ctx`` tokens (``kv_unified``, as ``llama-server
  --kv-unified``), so one slot can take a prompt as long as the whole context
  while eight short streams share it.  Its prompt cache is off: no host-memory
  cache (``cache_ram_mib 0``, so ``cache_idle_slots`` is off too) and every
  request says ``cache_prompt: false``; a slot then recomputes its whole
  prompt.  Threads: ``--threads`` (default: afm's, the physical cores) for
  generation and for batches.
* ``llama-cpp-python`` (target ``llamacpp_py``, optional): ``python -m
  llama_cpp.server`` from llama-cpp-python, built from source on this machine
  (``GGML_NATIVE``: the CPU's own instruction set, where the prebuilt
  xllamacpp wheel is built for AVX2 at most).  It serves one request at a
  time (a lock around one ``Llama``; no parallel slots), so it runs the
  single-stream phases only, never the 8-stream one.

The ISA each was built for is read from ggml's system-info line
(:func:`isa_summary`): the launcher prints it for xllamacpp; for
llama-cpp-python it is asked in a fresh process at the end of the run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ._servers import HOST, ServerSpec

__all__ = ["LLAMACPP", "LLAMACPP_PY", "LLAMACPP_PY_PACKAGE", "XLLAMACPP_PACKAGE", "isa_summary",
           "launcher_info", "llamacpp_py_spec", "llamacpp_py_system_info", "llamacpp_py_unavailable",
           "xllamacpp_spec", "xllamacpp_unavailable"]

LLAMACPP = "llama.cpp"
LLAMACPP_PY = "llama-cpp-python"
XLLAMACPP_PACKAGE = "xllamacpp==2026.10.11549"
LLAMACPP_PY_PACKAGE = "llama-cpp-python[server]==0.3.36"
LAUNCHER = Path(__file__).with_name("_llamacpp_launcher.py")
MARK = "afm-bench-llamacpp:"  # the launcher's line (see _llamacpp_launcher.MARK)

#: what every llama.cpp request adds to its body: no reuse of a slot's KV cache
REQUEST_EXTRA: dict[str, Any] = {"cache_prompt": False}


def xllamacpp_unavailable() -> str | None:
    """Why the ``llama.cpp`` peer cannot run here, or None when it can."""
    hint = (f"install it with: pip install '{XLLAMACPP_PACKAGE}' (a prebuilt llama.cpp; "
            "also in the extra 'afm[bench-llamacpp]')")
    try:
        found = importlib.util.find_spec("xllamacpp") is not None
    except (ImportError, ValueError) as exc:
        return f"xllamacpp cannot be imported ({exc}); {hint}"
    return None if found else f"xllamacpp is not installed; {hint}"


def xllamacpp_spec(gguf: str | Path, port: int, *, threads: int, parallel: int, n_ctx: int,
                   settings: tuple[str, ...] = (), name: str = LLAMACPP) -> ServerSpec:
    """The launcher's command line for llama.cpp's server loop on ``gguf``
    (``settings``: more ``KEY=VALUE`` for its ``CommonParams``, after ours)."""
    base = (f"n_parallel={parallel}", "kv_unified=true", f"n_ctx={n_ctx}",
            f"cpuparams.n_threads={threads}", f"cpuparams_batch.n_threads={threads}",
            "cache_ram_mib=0", "cache_idle_slots=false", "endpoint_metrics=true")
    argv: tuple[str, ...] = (sys.executable, str(LAUNCHER), "--model", str(gguf), "--host", HOST,
                             "--port", str(port))
    for item in (*base, *settings):
        argv += ("--set", item)
    return ServerSpec(name, argv, model_field=None, health_path="/health")


def launcher_info(log_path: Path) -> dict[str, Any] | None:
    """The launcher's ``MARK {json}`` line from its log, if printed."""
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if line.startswith(MARK):
                    value = json.loads(line[len(MARK):])
                    return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None
    return None


def isa_summary(system_info: str | None) -> str | None:
    """The widest x86/Arm SIMD a ggml build uses, from its system-info line
    (``AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1`` -> ``avx512-vnni``)."""
    if not system_info:
        return None
    flags = {part.split("=")[0].strip().upper() for part in system_info.replace(":", "|").split("|")
             if part.strip().endswith("= 1") or part.strip().endswith("=1")}
    if "AVX512" in flags:
        return "avx512-vnni" if "AVX512_VNNI" in flags else "avx512"
    if "AVX2" in flags:
        return "avx2-vnni" if "AVX_VNNI" in flags else "avx2"
    if "NEON" in flags:
        return "neon"
    return "scalar" if flags else None


def llamacpp_py_unavailable() -> str | None:
    """Why ``llama_cpp.server`` cannot run here, or None when it can."""
    hint = (f"install it with: pip install '{LLAMACPP_PY_PACKAGE}' (it compiles llama.cpp, "
            "several minutes)")
    try:
        if importlib.util.find_spec("llama_cpp") is None:
            return f"llama-cpp-python is not installed; {hint}"
        missing = [m for m in ("fastapi", "uvicorn", "sse_starlette", "pydantic_settings",
                               "starlette_context") if importlib.util.find_spec(m) is None]
    except (ImportError, ValueError) as exc:
        return f"llama-cpp-python cannot be imported ({exc}); {hint}"
    if missing:
        return f"llama-cpp-python's server extra is missing ({', '.join(missing)}); {hint}"
    return None


def llamacpp_py_spec(gguf: str | Path, port: int, *, threads: int = 2, n_ctx: int = 2048,
                     extra: tuple[str, ...] = ()) -> ServerSpec:
    """``python -m llama_cpp.server`` on a GGUF file, one request at a time.

    By default (``interrupt_requests``) it cuts a streamed answer short as
    soon as another request waits: turned off.  Its ``logits_all`` (on by
    default, for ``logprobs``) computes the vocabulary's logits at every
    prompt position and keeps an ``n_ctx`` x vocabulary buffer; neither afm
    nor llama.cpp's own server does that, so it is off too (a 514-token
    prefill 20% faster, 200 MB less).  ``/v1/models`` is its health check.
    """
    argv: tuple[str, ...] = (
        sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", HOST,
        "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
        "--n_ctx", str(n_ctx), "--interrupt_requests", "False", "--logits_all", "False",
        "--verbose", "False")
    return ServerSpec(LLAMACPP_PY, argv + extra, model_field=None, health_path="/v1/models")


def llamacpp_py_system_info() -> str | None:
    """llama-cpp-python's ``system_info`` line (CPU features, BLAS) in a fresh process."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
