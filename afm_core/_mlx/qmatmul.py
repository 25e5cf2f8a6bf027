"""A fast quantized matrix product for MLX's CPU backend.

MLX's own ``mx.quantized_matmul`` on the CPU is slower than a float32 product
through BLAS (1 x 576 @ 576 x 1536: 1.22 ms for 4 and 8 bits against 0.29 ms
in float32; 128 rows: 153 ms against 4.5 ms), so a quantized model decodes
slower than its float32 twin although it reads 4-8x fewer bytes.
``afm_core._mlx.qmm_ext`` (``ext/qmm/``) is an MLX primitive for the same
product on MLX's affine layout (2, 3, 4, 5, 6 or 8 bits: every width but 1;
groups of 32, 64 or 128; float32, float16 or bfloat16 scales), computed as
llama.cpp does:

* each activation row is quantized to int8 per block of 32 values and the
  products run on 8-bit integers (AVX2 ``vpmaddubsw`` or AVX-512 VNNI
  ``vpdpbusd``, chosen at run time; NEON on arm64; a portable scalar loop
  otherwise), every weight byte read once for up to 4 rows at a time, the
  output rows split over a small persistent thread pool; the default 16-bit
  precision adds an int8 remainder product, except on the ``avx512-vnni``
  kernels (512-bit registers), which quantize to int16 and use one
  ``vpdpwssd`` product, reduce 16 blocks at a time to one register before
  the float stage, and reuse each unpacked weight row for up to 8 rows, so a
  few rows (batched decode, speculation's verify pass) cost little more than
  one.  Whatever the kernels, a row's output does not depend on the other rows
  of the product (the verify pass must give one-row decoding's bits);
* the bias term uses the exact float sum of each group, so the only error
  beyond float rounding is the activations' int8 rounding: about 1% of the
  largest output for Gaussian data (0.5% typical), the same trade llama.cpp
  makes (``tests/mlx/test_qmatmul.py`` states the bounds);
* from ``AFM_QMM_GEMM_ROWS`` rows (default 64 on AVX-512 VNNI, 32 on the
  other kernel sets: prefill; ``qmm_ext.gemm_rows()``) the weight is
  dequantized tile by tile and multiplied by the process's ``cblas_sgemm``
  (the OpenBLAS ``afm_core._mlx.blas`` binds), at float32 precision.

:func:`quantized_matmul` is ``mx.quantized_matmul``'s signature and falls back
to it whenever the extension is missing or disabled (``AFM_NO_QMM=1``, or
``AFM_NO_EXTENSIONS=1``), the device is not the CPU, or the layout is one the
kernels do not cover.  ``afm_core._mlx.qmm_layers.use_fast_qmm`` switches a
model's ``nn.QuantizedLinear`` layers, and a quantized embedding used as the
output head (``as_linear``), to the layer classes here in place (a class swap,
as ``afm_core._mlx.fusion`` does; ``restore_qmm`` swaps back);
``afm_core._mlx.fusion.fuse_cpu_kernels`` calls both.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn

__all__ = [
    "kernel_isa",
    "qmm_available",
    "quantized_matmul",
    "residual_product",
    "supports",
]

log = logging.getLogger("afm.engine")

NO_QMM_ENV = "AFM_NO_QMM"


class _Extension(Protocol):
    """The face of ``afm_core._mlx.qmm_ext``."""

    def quantized_matmul(self, x: mx.array, w: mx.array, scales: mx.array,
                         biases: mx.array, group_size: int, bits: int,
                         bias: mx.array | None = None, residual: mx.array | None = None) -> mx.array: ...
    def quantized_matmul_split(self, x: mx.array, w: mx.array, scales: mx.array,
                               biases: mx.array, group_size: int, bits: int, splits: list[int],
                               bias: list[mx.array | None] = ..., norm_weight: mx.array | None = None,
                               norm_eps: float = 0.0,
                               shapes: Sequence[Sequence[int]] = ...,
                               rope_offset: mx.array | None = None, rope_freqs: mx.array | None = None,
                               rope_dims: int = 0, rope_traditional: bool = False,
                               rope_outputs: int = 0) -> list[mx.array]: ...
    def quantized_matmul_swiglu(self, x: mx.array, w: mx.array, scales: mx.array,
                                biases: mx.array, group_size: int, bits: int,
                                norm_weight: mx.array | None = None, norm_eps: float = 0.0) -> mx.array: ...
    def isa(self) -> str: ...
    def available_isas(self) -> list[str]: ...
    def set_isa(self, name: str) -> bool: ...
    def num_threads(self) -> int: ...
    def set_thread_limit(self, n: int) -> None: ...
    def has_sgemm(self) -> bool: ...
    def set_gemm_rows(self, n: int) -> None: ...
    def gemm_rows(self) -> int: ...
    def set_activation_bits(self, bits: int) -> None: ...
    def set_kquant_activation_bits(self, bits: int) -> None: ...
    def decode_attention(self, q: mx.array, k: mx.array, v: mx.array, scale: float,
                         mask: mx.array | None = None, causal: bool = False, length: int = -1,
                         merge_heads: bool = False) -> mx.array: ...
    def rms_norm(self, x: mx.array, weight: mx.array, eps: float) -> mx.array: ...
    def rope_decode(self, x: mx.array, offset: mx.array, freqs: mx.array, dims: int,
                    traditional: bool) -> mx.array: ...
    def rope_decode_pair(self, q: mx.array, k: mx.array, offset: mx.array, freqs: mx.array, dims: int,
                         traditional: bool) -> list[mx.array]: ...
    def kv_write(self, buffer: mx.array, x: mx.array, at: int) -> None: ...


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _load() -> _Extension | None:
    if _flag(NO_QMM_ENV) or _flag("AFM_NO_EXTENSIONS"):
        return None
    import importlib.util

    if importlib.util.find_spec("afm_core._mlx.qmm_ext") is None:
        return None  # not built: MLX's kernel, as documented
    try:
        from . import qmm_ext as _qmm_ext  # type: ignore[attr-defined]
    except ImportError as exc:  # built but broken (stale against mlx, missing libmlx): say so
        log.warning("afm_core._mlx.qmm_ext is built but does not load (%s); quantized products "
                    "use MLX's kernel (rebuild with `make install`)", exc)
        return None
    return cast(_Extension, _qmm_ext)


_ext: _Extension | None = _load()

_SCALE_TYPES = (mx.float32, mx.float16, mx.bfloat16)
KERNEL_BITS = (2, 3, 4, 5, 6, 8)
"""The affine bit widths the kernels cover (MLX's 1-bit layout stays on MLX)."""
KERNEL_GROUPS = (32, 64, 128)
KQUANT_GROUP = 256
"""``group_size`` of a layer whose weight is GGUF's K-quant blocks as they are
(``afm_core._mlx.kquant``; ``bits`` 4: Q4_K, 6: Q6_K): uint8 rows of whole
blocks of 256 values, its scales and biases empty (the blocks hold them)."""
KQUANT_BLOCK_BYTES = {4: 144, 6: 210}


def extension() -> _Extension | None:
    """The loaded ``afm_core._mlx.qmm_ext`` (which also holds the decode
    attention kernel, ``afm_core._mlx.attention``, and the one-operation norm
    and rotary embedding ``afm_core._mlx.fusion`` uses), or None."""
    return _ext


def qmm_available() -> bool:
    """Whether the compiled kernels are loaded (and not disabled)."""
    return _ext is not None


def kernel_isa() -> str | None:
    """The instruction set of the kernels in use, or None without them."""
    return _ext.isa() if _ext is not None else None


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def is_kquant(layer: Any) -> bool:
    """Whether ``layer``'s weight is GGUF's K-quant blocks (:data:`KQUANT_GROUP`)."""
    return getattr(layer, "group_size", None) == KQUANT_GROUP


def input_dims(layer: Any) -> int:
    """The number of inputs of a quantized linear layer (its rows' values)."""
    width = int(layer["weight"].shape[-1])
    if is_kquant(layer):
        return width // KQUANT_BLOCK_BYTES[int(layer.bits)] * KQUANT_GROUP
    return width * 32 // int(layer.bits)


def supports(w: mx.array, scales: mx.array, biases: mx.array | None,
             group_size: int, bits: int, mode: str = "affine") -> bool:
    """Whether the kernels cover this layout (the device aside)."""
    if group_size == KQUANT_GROUP:
        return (mode == "affine" and bits in KQUANT_BLOCK_BYTES and w.ndim == 2 and w.dtype == mx.uint8
                and w.shape[1] % KQUANT_BLOCK_BYTES[bits] == 0 and scales.size == 0
                and biases is not None and biases.size == 0)
    return (mode == "affine" and biases is not None and bits in KERNEL_BITS
            and group_size in KERNEL_GROUPS and w.ndim == 2 and w.dtype == mx.uint32
            and scales.dtype in _SCALE_TYPES and biases.dtype == scales.dtype
            and scales.ndim == 2)


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None,
                     transpose: bool = True, group_size: int = 64, bits: int = 4,
                     mode: str = "affine") -> mx.array:
    """``mx.quantized_matmul`` through the fast kernels where they apply."""
    if (_ext is not None and transpose and biases is not None and _on_cpu()
            and supports(w, scales, biases, group_size, bits, mode)
            and mx.issubdtype(x.dtype, mx.floating)):
        return _ext.quantized_matmul(x, w, scales, biases, group_size, bits)
    return mx.quantized_matmul(x, w, scales, biases, transpose=transpose,
                               group_size=group_size, bits=bits, mode=mode)


def _mode(layer: Any) -> str:
    return str(getattr(layer, "mode", "affine"))


def fused_bias(layer: Any, x: mx.array) -> mx.array | None:
    """``layer``'s bias when the product can add it itself: of ``x``'s dtype
    (the sum's dtype is then the product's, as with MLX's own add), 1-D."""
    bias = layer.get("bias") if "bias" in layer else None
    if bias is not None and bias.dtype == x.dtype and bias.ndim == 1:
        return bias  # type: ignore[no-any-return]
    return None


_SYMMETRIC = "_afm_symmetric"


def symmetric_factor(scales: mx.array, biases: mx.array, bits: int) -> mx.array | None:
    """The kernels' 0-d ``biases`` argument for a symmetric weight, whose
    every bias is exactly ``-2^(bits-1)`` times its group's scale (GGUF's
    Q4_0, Q5_0, Q8_0, Q6_K and Q3_K as the conversion writes them), or None.
    With it the kernels make each bias from the scale they read anyway (the
    same float32 values), so a one-row product reads 2 bytes a group fewer:
    6-10% of a 4-8 bit weight's bytes."""
    c = -(1 << (bits - 1))
    if scales.size == 0:  # K-quant blocks: no scales here to make biases from
        return None
    if biases.shape != scales.shape or biases.dtype != scales.dtype or scales.dtype not in _SCALE_TYPES:
        return None
    # the kernels' float32 c * scale against the biases as float32: equal, or not symmetric
    if not mx.array_equal(biases.astype(mx.float32), scales.astype(mx.float32) * c).item():
        return None
    return mx.array(c, dtype=scales.dtype)


def note_symmetric(layer: Any) -> bool:
    """Note on a fast layer whether its weight is symmetric
    (:func:`symmetric_factor`), for :func:`kernel_biases`; returns whether."""
    scales, biases = layer["scales"], layer["biases"]
    factor = symmetric_factor(scales, biases, int(layer.bits))
    object.__setattr__(layer, _SYMMETRIC, (scales, biases, factor if factor is not None else biases))
    return factor is not None


def forget_symmetric(layer: Any) -> None:
    layer.__dict__.pop(_SYMMETRIC, None)


def kernel_biases(layer: Any) -> mx.array:
    """The ``biases`` argument of ``layer``'s kernel calls: the factor
    :func:`note_symmetric` found while the layer holds the scales and biases
    it was noted with, else its biases (new weights drop the note)."""
    biases = layer["biases"]
    noted = layer.__dict__.get(_SYMMETRIC)
    if noted is not None:
        if noted[0] is layer["scales"] and noted[1] is biases:
            return noted[2]  # type: ignore[no-any-return]
        del layer.__dict__[_SYMMETRIC]
    return biases  # type: ignore[no-any-return]


class _FastQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose product runs on ``afm_core._mlx.qmm_ext``
    (its bias added by the same operation where the dtypes allow)."""

    def __call__(self, x: mx.array) -> mx.array:
        assert _ext is not None
        bias = fused_bias(self, x)
        y = _ext.quantized_matmul(x, self["weight"], self["scales"], kernel_biases(self),
                                  self.group_size, self.bits, bias)
        if "bias" in self and bias is None:
            y = y + self["bias"]
        return y


def residual_product(layer: Any, x: mx.array, residual: mx.array) -> mx.array:
    """``residual + layer(x)``, as one operation when ``layer`` is a
    :class:`_FastQuantizedLinear` whose bias the product adds (or that has
    none) and everything is float32: the residual is then added in the
    product's epilogue, the same float32 addition (``qmm_ext``)."""
    if type(layer) is _FastQuantizedLinear and _ext is not None and x.dtype == residual.dtype == mx.float32:
        bias = fused_bias(layer, x)
        if ("bias" not in layer or bias is not None) and residual.shape == (*x.shape[:-1], layer["weight"].shape[0]):
            return _ext.quantized_matmul(x, layer["weight"], layer["scales"], kernel_biases(layer),
                                         layer.group_size, layer.bits, bias, residual)
    return residual + layer(x)  # type: ignore[no-any-return]


class _FastQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied output head)
    runs on ``afm_core._mlx.qmm_ext``."""

    def as_linear(self, x: mx.array) -> mx.array:
        assert _ext is not None
        return _ext.quantized_matmul(x, self["weight"], self["scales"], kernel_biases(self),
                                     self.group_size, self.bits)


def _layer_supported(layer: Any) -> bool:
    biases = layer.get("biases") if isinstance(layer, dict) else None
    return biases is not None and supports(layer["weight"], layer["scales"], biases,
                                           layer.group_size, layer.bits, _mode(layer))
