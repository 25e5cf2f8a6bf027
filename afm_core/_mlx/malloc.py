"""Give freed tensors back to the system: glibc's mmap threshold, fixed.

MLX's CPU backend takes its buffers from ``malloc``.  glibc serves a request
of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` (unmapped, so
given back, when freed) and anything smaller from its heaps, which keep
what is freed.  By default the threshold moves: every freed mapped chunk
raises it to that chunk's size, up to 32 MiB.  A server's first requests
free a few such chunks, after which every KV-cache layer buffer, every
prefill chunk's activations (a few MiB each) comes from the heaps, and what
a long prompt frees stays in the process: the default model, serving prompts
of 0.5k, 4k and 8k tokens, held 846 MiB resident afterwards for 380 MiB that
MLX still used (``benchmarks/README.md``, "Peak memory").

:func:`tune` fixes the threshold at :data:`MMAP_THRESHOLD` (which also turns
the moving threshold off), so buffers of a MiB or more are mapped and
unmapped.  MLX keeps its own cache of freed buffers above ``malloc``
(``mx.get_cache_memory``), which is what decode steps reuse, so steady
decoding does not map anything.  It changes nothing where the user set
``MALLOC_MMAP_THRESHOLD_`` (glibc read theirs), where ``AFM_MALLOC=system``,
or off glibc.  ``import afm_core`` calls it.

Smaller blocks still come from the heaps, and what is freed between live
ones stays there: loading a tokenizer parses its JSON into many small
objects (Qwen's ``tokenizer.json``: 84 MiB freed after the load, all of it
kept).  :func:`trim` (glibc's ``malloc_trim``) gives the free pages of every
heap back; the engine calls it once the model is loaded and whenever it
falls idle.

May import: the standard library only.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["MMAP_THRESHOLD", "trim", "tune"]

MMAP_THRESHOLD = 1 << 20
"""Bytes from which glibc maps a request instead of taking it from a heap."""

_M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>

_tuned: bool | None = None


def _libc() -> ctypes.CDLL | None:
    """The C library where it is glibc and ``AFM_MALLOC`` is not ``system``."""
    if os.environ.get("AFM_MALLOC", "") == "system":
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def trim() -> bool:
    """Give the free pages of glibc's heaps back to the system
    (``malloc_trim(0)``); whether any were (False off glibc or with
    ``AFM_MALLOC=system``)."""
    libc = _libc()
    fn = getattr(libc, "malloc_trim", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return bool(fn(0))


def tune() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (once per process);
    whether it is fixed by this call or an earlier one."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    libc = None if "MALLOC_MMAP_THRESHOLD_" in os.environ else _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _tuned
