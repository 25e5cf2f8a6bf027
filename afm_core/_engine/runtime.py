"""What this process computes with: the BLAS, the quantized kernel, the compiled twins.

The public :func:`afm_core.runtime_info` (shown by ``/health`` and ``afm
serve``'s start-up log) so that adapters never import the modules that know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._mlx.blas import blas_info
from .._mlx.qmatmul import kernel_isa
from .._stream import accumulate, detok, pipeline, reasoning, sse, tools

__all__ = ["RuntimeInfo", "runtime_info"]

_DISPATCHERS = {
    "accumulate": accumulate, "detok": detok, "pipeline": pipeline,
    "reasoning": reasoning, "sse": sse, "tools": tools,
}


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """The process's compute back-ends (a snapshot)."""

    blas: dict[str, Any]
    """The BLAS under MLX's CPU products: ``name`` (``openblas``, ``reference``,
    ``accelerate``), ``detail``, ``threads``, ``reason`` when not optimized, and
    ``verified`` once a product was seen to reach it."""
    quantized_kernel: str | None
    """The instruction set of afm's quantized matmul kernels (``avx2-vnni``,
    ``avx512-vnni``, ``neon``...), or None when MLX's own is used."""
    compiled: dict[str, bool]
    """For each stream stage with a Cython build: whether that build is in use
    (False: its pure-Python twin)."""

    def as_dict(self) -> dict[str, Any]:
        return {"blas": self.blas, "quantized_kernel": self.quantized_kernel,
                "compiled": dict(self.compiled)}


def runtime_info() -> RuntimeInfo:
    """The BLAS, quantized kernel and twins this process uses now."""
    return RuntimeInfo(
        blas=blas_info().as_dict(),
        quantized_kernel=kernel_isa(),
        compiled={name: mod.COMPILED for name, mod in _DISPATCHERS.items()},
    )
