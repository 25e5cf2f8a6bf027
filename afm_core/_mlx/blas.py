"""Bind MLX's BLAS calls to an optimized BLAS on Linux, before MLX runs a product.

MLX's Linux wheel (``mlx[cpu]``) links the reference netlib BLAS, and its CPU
backend computes every float32 matrix product, decode-time matrix-vector
products included, through ``cblas_sgemm`` (also ``cblas_dgemm`` and
``cblas_cgemm``; nothing else).  Netlib's loops are not blocked nor
vectorized: 2-4 GFLOP/s here, against 50-190 for OpenBLAS on one machine.

:func:`ensure_loaded` makes those three calls reach OpenBLAS from the
``scipy-openblas32`` wheel (a dependency on Linux), which exports them only
under prefixed names (``scipy_cblas_sgemm``).  ``afm_core._mlx.cblas_shim``
(``ext/blas/cblas_shim.c``) exports the plain names and forwards through
function pointers set here; loaded with ``RTLD_GLOBAL`` it stands in the
global symbol scope, which the dynamic linker searches before ``libmlx.so``'s
own dependencies when it loads ``libmlx.so``.  So it must happen before the
first ``import mlx.core`` of the process: ``import afm_core`` does it first
thing (a process that imported MLX earlier keeps the reference BLAS, with a
log line saying so).  The shim counts the products it forwards, and
:func:`confirm` checks with one small product that MLX's calls arrive.

Chosen by measurement (1 x 576 @ 576 x 1536, the default model's MLP; 512
rows for prefill): scipy-openblas32 0.3.34 0.07-0.15 ms and 130-190 GFLOP/s,
MKL 2026.2 (``libmkl_rt``, plain names, no shim) 0.12 ms but a 229 MB wheel,
Intel's OpenMP runtime besides and Intel-only tuning; the reference BLAS
0.65-0.95 ms and 2-4 GFLOP/s.

Settings, read once:

* ``AFM_BLAS=reference`` keeps MLX's own BLAS (``auto``, the default, binds
  OpenBLAS where it can).
* ``AFM_BLAS_GEMV=auto|on|off``: a one-row product (a decode step's
  ``1 x K @ K x N``) goes to OpenBLAS's ``sgemv`` instead of its ``sgemm``
  when ``N >= K`` (``auto``, the default), always (``on``) or never
  (``off``).  OpenBLAS's sgemm is slow for one row of a wide output: the
  default model's 576 x 49152 head took 29.8 ms through sgemm against 15.4
  through sgemv, a 576 x 1536 up-projection 0.48 against 0.08 ms, while for a
  narrow output (1536 x 576) sgemm was the faster (0.06 against 0.19 ms).
* ``AFM_BLAS_THREADS=N``: OpenBLAS's threads; by default the physical cores
  this process may run on.  numpy's own OpenBLAS (``scipy_openblas64_``,
  another copy with its own pool) is left as it is: afm computes no numpy
  matrix products while serving, and an idle OpenBLAS pool sleeps.

Nothing here raises: a missing wheel, a shim that was not built or a library
that fails to load leaves MLX's BLAS in place with one log line saying why.
On macOS MLX uses Accelerate (and Metal), and nothing changes.

Fork safety: OpenBLAS re-creates its thread pool in a forked child
(``pthread_atfork``); ``tests/mlx/test_blas.py`` computes through the shim in a
child forked after use.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BlasInfo", "blas_info", "ensure_loaded", "physical_cores"]

log = logging.getLogger("afm.blas")

BLAS_ENV = "AFM_BLAS"
THREADS_ENV = "AFM_BLAS_THREADS"
GEMV_ENV = "AFM_BLAS_GEMV"
_GEMV_MODES = {"off": 0, "auto": 1, "on": 2}
_CHOICES = ("auto", "reference")
_LATE = "mlx.core was imported before afm_core; import afm_core first"


@dataclass(frozen=True, slots=True)
class BlasInfo:
    """Which BLAS computes MLX's CPU matrix products in this process.

    ``name`` is ``"openblas"`` (bound here), ``"reference"`` (MLX's Linux
    wheel's own netlib BLAS) or ``"accelerate"`` (macOS); ``reason`` says why
    the reference BLAS is in use; ``verified`` is True once MLX's products
    were seen arriving at the bound library (None before the first one).
    """

    name: str
    detail: str = ""
    threads: int | None = None
    reason: str = ""
    verified: bool | None = None

    def describe(self) -> str:
        """One line for logs and profiles, e.g. ``openblas (OpenBLAS 0.3.34 ..., 2 threads)``."""
        if self.name == "openblas":
            return f"openblas ({self.detail}, {self.threads} threads)"
        return f"{self.name} ({self.reason})" if self.reason else self.name

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name}
        if self.detail:
            out["detail"] = self.detail
        if self.threads is not None:
            out["threads"] = self.threads
        if self.reason:
            out["reason"] = self.reason
        if self.verified is not None:
            out["verified"] = self.verified
        return out


_lock = threading.Lock()
_info: BlasInfo | None = None
_shim: ctypes.CDLL | None = None
_verified: bool | None = None


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (at least 1)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores: set[tuple[str, str]] = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add((package, core))
    return max(1, len(cores))


def _threads() -> int:
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value >= 1:
            return value
        log.warning("%s=%r is not a positive integer; using the physical cores", THREADS_ENV, raw)
    return physical_cores()


def _shim_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"cblas_shim{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _bind_openblas() -> BlasInfo:
    try:
        import scipy_openblas32
    except ImportError:
        return BlasInfo("reference", reason="the scipy-openblas32 wheel is not installed")
    shim_file = _shim_path()
    if shim_file is None:
        return BlasInfo("reference", reason="afm_core._mlx.cblas_shim was not built")
    lib_file = Path(scipy_openblas32.get_lib_dir()) / f"lib{scipy_openblas32.get_library()}.so"
    try:
        lib = ctypes.CDLL(str(lib_file))
        shim = ctypes.CDLL(str(shim_file), mode=os.RTLD_GLOBAL)
        funcs = [ctypes.cast(getattr(lib, f"scipy_cblas_{n}"), ctypes.c_void_p) for n in ("sgemm", "dgemm", "cgemm")]
        threads = _threads()
        lib.scipy_openblas_set_num_threads(ctypes.c_int(threads))
        lib.scipy_openblas_get_config.restype = ctypes.c_char_p
        config = (lib.scipy_openblas_get_config() or b"").decode("ascii", "replace").strip()
        shim.afm_cblas_calls.restype = ctypes.c_ulong
        shim.afm_cblas_gemv_calls.restype = ctypes.c_ulong
        if shim.afm_cblas_bind(*funcs) != 0:
            return BlasInfo("reference", reason="the shim refused the OpenBLAS functions")
        shim.afm_cblas_bind_sgemv(ctypes.cast(lib.scipy_cblas_sgemv, ctypes.c_void_p))
        shim.afm_cblas_gemv_mode(ctypes.c_int(_gemv_mode()))
    except (OSError, AttributeError) as exc:
        return BlasInfo("reference", reason=f"loading OpenBLAS failed: {exc}")
    global _shim
    _shim = shim
    return BlasInfo("openblas", detail=config, threads=threads)


def _gemv_mode() -> int:
    raw = os.environ.get(GEMV_ENV, "auto").strip().lower() or "auto"
    if raw not in _GEMV_MODES:
        log.warning("%s=%r is not one of %s; using auto", GEMV_ENV, raw, ", ".join(_GEMV_MODES))
        raw = "auto"
    return _GEMV_MODES[raw]


def ensure_loaded() -> BlasInfo:
    """Bind OpenBLAS under MLX once per process (idempotent, never raises)."""
    global _info
    with _lock:
        if _info is not None:
            return _info
        choice = os.environ.get(BLAS_ENV, "auto").strip().lower() or "auto"
        if sys.platform == "darwin":
            info = BlasInfo("accelerate")
        elif not sys.platform.startswith("linux"):
            info = BlasInfo("reference", reason=f"no optimized BLAS binding on {sys.platform}")
        elif choice not in _CHOICES:
            info = BlasInfo("reference", reason=f"{BLAS_ENV}={choice!r} (expected one of {', '.join(_CHOICES)})")
        elif choice == "reference":
            info = BlasInfo("reference", reason=f"{BLAS_ENV}=reference")
        elif "mlx.core" in sys.modules:
            info = BlasInfo("reference", reason=_LATE)
        else:
            info = _bind_openblas()
        _info = info
    if info.reason:
        log.warning("BLAS: MLX's reference BLAS computes CPU products (%s)", info.reason)
    return info


def blas_info() -> BlasInfo:
    """The BLAS in use; ``verified`` once :func:`confirm` or a product said so."""
    info = ensure_loaded()
    if _shim is None:
        return info
    if _verified is False:
        return BlasInfo("reference", reason="MLX's products do not reach the bound OpenBLAS")
    seen = True if _verified or products_forwarded() else None
    return BlasInfo(info.name, info.detail, info.threads, info.reason, verified=seen)


def confirm() -> BlasInfo:
    """Compute one small float32 product with MLX and see whether it arrived.

    Runs on the thread that owns MLX (the engine's generation thread, at
    start).  Should another library have put its own ``cblas_sgemm`` first
    in the process's global scope, MLX's products never reach OpenBLAS:
    that is logged once, and :func:`blas_info` then says ``reference``.
    """
    global _verified
    ensure_loaded()
    if _shim is None or _verified is not None:
        return blas_info()
    import mlx.core as mx

    before = products_forwarded()
    a = mx.ones((8, 8), dtype=mx.float32)
    mx.eval(mx.matmul(a, a, stream=mx.cpu))
    _verified = products_forwarded() > before
    if not _verified:
        log.warning("BLAS: OpenBLAS is loaded but MLX's products do not reach it; "
                    "MLX's own BLAS computes them")
    return blas_info()


def one_row_products() -> int:
    """How many of :func:`products_forwarded` went to OpenBLAS's sgemv (``AFM_BLAS_GEMV``)."""
    return 0 if _shim is None else int(_shim.afm_cblas_gemv_calls())


def products_forwarded() -> int:
    """How many BLAS products the shim forwarded to OpenBLAS (0 when unbound)."""
    return 0 if _shim is None else int(_shim.afm_cblas_calls())
