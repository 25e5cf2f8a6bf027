"""Fused element-wise kernels and matmul-friendly weights for MLX's CPU backend.

On the GPU, MLX runs ``mx.fast.rms_norm`` and ``mx.fast.rope`` as one kernel
each.  The CPU backend has no such kernels: each call expands into its
reference graph (square, sum, rsqrt, multiplies and broadcasts for a norm;
arange, cos, sin, slices and concatenation for a rotary embedding), and every
operation of it is a task of its own for MLX's CPU scheduler.  For the decode
step of a small model the cost follows the number of operations, not the
arithmetic: the tiny test model's step is 358 operations with mlx's layers
and 198 with these (``benchmarks/cpu_fusion.py`` prints them by primitive).

:func:`fuse_cpu_kernels` makes the model's ``nn.RMSNorm`` and ``nn.RoPE``
layers call ``mx.compile``-d kernels, in which MLX fuses each run of
element-wise operations into one generated kernel (the generated code may
contract a multiply and an add into one fused multiply-add, so results agree
with mlx's layers to float rounding).

* Norms compile ``mx.fast.rms_norm`` itself: a shape-keyed trace for decode
  shapes (one token per row, which repeat from step to step) and a shapeless
  one for every other shape.
* Rotary embeddings at decode (one position per row, positions given as an
  array, as in mlx-lm's batch caches) use the slice-free form described in
  :class:`_RopeKernels`, one trace per batch width and head count.  Prefill
  calls, whose lengths vary, keep mlx's own function.

With afm's CPU extension built (``afm_core._mlx.qmm_ext``), float32 norms (of
any number of rows) and rotary embeddings (of any number of positions per
row, at an int or array offset: decode, verify and prompt chunks) go
one step further: each is one MLX operation (``ext/qmm/layer_ops.cpp``)
instead of a cast, a square, a sum and a kernel for a norm, or a product, its
reshapes and a kernel (or mlx's thirty-odd operations) for a rotary embedding;
``AFM_NO_LAYER_OPS=1`` keeps the compiled kernels
(``tests/mlx/test_layer_ops.py`` checks both against mlx's layers).

Only layers whose class is exactly ``nn.RMSNorm``, ``nn.RoPE``, ``nn.Linear``
or ``nn.Embedding`` change, and Gemma 2's and 3's ``RMSNorm``
(``rms_norm(x, 1 + weight)``): the norm kernels above by ``1 + weight``,
made once per weight array (the values mlx-lm's call adds every time), so
each of a Gemma 3 layer's six norms is one operation instead of about ten,
its outputs mlx-lm's to float rounding as for ``nn.RMSNorm``; other
model-specific variants keep their own code.  The kernels are made per
call, so two engines in one process never share a compiled function.

Matrix products go to the BLAS under MLX.  Normally that is OpenBLAS
(``afm_core._mlx.blas``), which reads a weight in either order at full speed and
computes the output head 2x faster read as ``nn.Embedding.as_linear`` does;
weights then stay as they are.  With the reference (netlib) BLAS that the
Linux wheel ships (``AFM_BLAS=reference``, or no OpenBLAS), loops vectorize
when the weight is in (input, output) order and not when it is read
transposed, which is how ``nn.Linear`` and a tied ``Embedding.as_linear``
compute.  Plain ``nn.Linear`` layers then keep their weight transposed and
contiguous (same bytes, so the same memory; each dot product sums its terms in the same order, so
without a bias the results are the same bits, and with one they differ by a
rounding, the bias being added at another point), and a tied embedding used
as the output head gets a transposed copy beside it when that copy is at
most ``TIED_HEAD_COPY_LIMIT`` bytes.  Products get 1.2-2.2x faster on this
wheel (``benchmarks/cpu_fusion.py`` measures the whole step).

MLX keeps compiled traces in a per-thread cache, and a compiled function
erases its traces only from the cache of the thread that frees it.  The
generation thread outlives its engine (see ``afm_core._engine.genthread``), so
:func:`unfuse_cpu_kernels` must run on that thread when the engine stops, or
the traces would stay in its cache for good.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

log = logging.getLogger("afm.engine")

TIED_HEAD_COPY_LIMIT = 256 << 20
"""Largest embedding (bytes) that gets a transposed copy for use as the output
head; a bigger one keeps the transposed read (no extra memory)."""

__all__ = ["fuse_cpu_kernels", "fuse_for_cpu", "unfuse_cpu_kernels", "wants_fusion"]

Kernel = Callable[[mx.array, mx.array], mx.array]


class _FusedRMSNorm(nn.RMSNorm):
    _kernels: tuple[Kernel, Kernel]  # (one token per row, any shape)
    _one_operation = False  # float32 inputs take the extension's rms_norm (a product's prologue can)

    def __call__(self, x: mx.array) -> mx.array:
        decode = x.ndim >= 3 and x.shape[1] == 1
        return self._kernels[0 if decode else 1](x, self["weight"])


_GEMMA_NORM_MODULES = ("gemma2", "gemma3_text")
"""mlx-lm architectures whose ``RMSNorm`` scales by ``1 + weight``
(``mx.fast.rms_norm(x, 1.0 + weight, eps)``)."""


def _gemma_norm_call(self: Any, x: mx.array) -> mx.array:
    return self._kernels[0 if x.ndim >= 3 and x.shape[1] == 1 else 1](x, self.scale())


def _gemma_norm_scale(self: Any) -> mx.array:
    """``1.0 + weight`` (the array mlx-lm's call computes each time),
    computed once per weight array."""
    weight = self["weight"]
    held = self._scale
    if held is None or held[0] is not weight:
        held = (weight, 1.0 + weight)
        mx.eval(held[1])
        object.__setattr__(self, "_scale", held)
    return held[1]  # type: ignore[no-any-return]


def _gemma_norms() -> dict[type, type]:
    """Gemma's norm classes and their fused classes: the norm of ``x`` by
    ``1 + weight`` on the kernels of :class:`_FusedRMSNorm` (one operation
    for float32 with the extension), the ``1 + weight`` made once instead
    of every call.  Each keeps mlx-lm's class as its first base."""
    import importlib

    norms: dict[type, type] = {}
    for name in _GEMMA_NORM_MODULES:
        base = importlib.import_module(f"mlx_lm.models.{name}").RMSNorm
        norms[base] = type("RMSNorm", (base,), {
            "__call__": _gemma_norm_call, "scale": _gemma_norm_scale, "__module__": __name__,
            "__qualname__": f"FusedRMSNorm.{name}", "_one_operation": False})
    return norms


_GEMMA_NORMS = _gemma_norms()
_FUSED_GEMMA_NORMS = frozenset(_GEMMA_NORMS.values())


def one_operation_norm(norm: Any) -> tuple[mx.array, float] | None:
    """The weight and eps of ``norm`` (afm's fused norm, or Gemma's with
    ``1 + weight`` as its weight) when its float32 calls are the
    extension's one-operation ``rms_norm`` of them; None otherwise."""
    if type(norm) is _FusedRMSNorm:
        weight = norm["weight"]
    elif type(norm) in _FUSED_GEMMA_NORMS:
        weight = norm.scale()
    else:
        return None
    return (weight, float(norm.eps)) if norm._one_operation and weight.dtype == mx.float32 else None


class RopeEpilogue(NamedTuple):
    """A quantized product's rotary epilogue: ``rope_decode``'s arguments."""

    offset: mx.array
    freqs: mx.array
    dims: int
    traditional: bool


class _FusedRoPE(nn.RoPE):
    _kernels: _RopeKernels

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if x.ndim == 4 and self._kernels.applies(x, offset):
            return self._kernels.get(x.shape[-1])(x, offset)
        return super().__call__(x, offset)

    def pair(self, q: mx.array, k: mx.array, offset: Any) -> tuple[mx.array, mx.array] | None:
        """``(self(q, offset), self(k, offset))`` as one operation where each
        alone would take the extension's kernel (the same bits); None otherwise."""
        return self._kernels.pair(q, k, offset)

    def epilogue(self, rows: int, head_dim: int, offset: Any) -> RopeEpilogue | None:
        """What a quantized product needs to embed its first outputs' positions
        in its epilogue (``quantized_matmul_split``'s ``rope_*``: the bits of
        :meth:`pair`) for ``rows`` rows of one position each, heads of
        ``head_dim``, at ``offset``; None where :meth:`pair` would not apply."""
        return self._kernels.epilogue(rows, head_dim, offset)


class _TransposedLinear(nn.Linear):
    """``nn.Linear`` whose ``weight`` is stored (input, output), contiguous."""

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, self["weight"])
        return x @ self["weight"]


class _HeadEmbedding(nn.Embedding):
    """``nn.Embedding`` with a transposed copy of its table for ``as_linear``."""

    _kernels: mx.array  # the table, (dims, vocabulary), contiguous

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self._kernels


def _norm_kernels(eps: float) -> tuple[Kernel, Kernel]:
    def norm(x: mx.array, weight: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, weight, eps)

    # decode shapes repeat, and a shape-keyed trace saves the element count
    # a shapeless one computes on every call
    by_shape, shapeless = mx.compile(norm), mx.compile(norm, shapeless=True)
    ops = _layer_ops()
    if ops is None:
        return by_shape, shapeless

    def one_operation(compiled: Kernel) -> Kernel:
        def kernel(x: mx.array, weight: mx.array) -> mx.array:
            if x.dtype == mx.float32 and weight.dtype == mx.float32:
                return ops.rms_norm(x, weight, eps)
            return compiled(x, weight)

        return kernel

    return one_operation(by_shape), one_operation(shapeless)


class _RopeKernels:
    """Rotary embedding of one position per row, as ``x*cos + rotate(x)*sin``
    over the whole head: ``rotate`` is a product with a fixed signed
    permutation (exact), the frequencies are computed as MLX's reference does,
    and dimensions past ``dims`` get angle 0 (they pass through).  Unlike the
    reference graph it needs no slicing, so most of it fuses into one kernel.
    One compiled kernel per head size.

    With the extension, float32 inputs of any number of positions (a decode
    step, a speculative verify step, a prompt's chunk) and an offset given as
    an int (mlx-lm's single-sequence cache) or an array (its batch cache) take
    the one-operation kernel instead, whose position l gives the bits of a
    one-position call at offset + l.  For a prompt that is also a quarter of
    MLX's time and memory: ``mx.fast.rope`` has no CPU kernel, and its
    reference graph keeps the cosine and sine tables and the rotated halves
    alive at once (a 2,048-token chunk of the default model's queries: 14
    MiB beside the 4.5 MiB output, 8.6 against 2.4 ms for a layer's pair)."""

    def __init__(self, dims: int, traditional: bool, base: float, scale: float):
        self.dims, self.traditional, self.base, self.scale = dims, traditional, base, scale
        self._by_head: dict[int, Kernel] = {}
        self._freqs: dict[int, mx.array] = {}
        self._ops = _layer_ops()

    def applies(self, x: mx.array, offset: Any) -> bool:
        """Whether :meth:`get`'s kernel computes ``x`` (B, H, L, D) at ``offset``."""
        array = isinstance(offset, mx.array)
        if array and not (offset.ndim == 0 or offset.shape == (x.shape[0],)):
            return False
        if x.shape[-2] == 1 and array:
            return True  # the compiled kernel's case
        return (self._ops is not None and x.dtype == mx.float32 and x.shape[-2] >= 1
                and (offset.dtype in _ROPE_OFFSET_TYPES if array else isinstance(offset, int)))

    def pair(self, q: mx.array, k: mx.array, offset: Any) -> tuple[mx.array, mx.array] | None:
        """Both embeddings as one operation (``rope_decode_pair``) where each
        alone would take the extension's one-operation kernel; None otherwise."""
        ops = self._ops
        if ops is None or q.ndim != 4 or k.ndim != 4 or q.shape[-1] != k.shape[-1]:
            return None
        if isinstance(offset, int):
            offset = mx.array(offset, dtype=mx.int32)
        if not (q.dtype == k.dtype == mx.float32 and isinstance(offset, mx.array)
                and offset.dtype in _ROPE_OFFSET_TYPES and self.applies(q, offset) and self.applies(k, offset)):
            return None
        self.get(q.shape[-1])  # (its frequencies)
        q, k = ops.rope_decode_pair(q, k, offset, self._freqs[q.shape[-1]], 2 * (self.dims // 2),
                                    self.traditional)
        return q, k

    def epilogue(self, rows: int, head_dim: int, offset: Any) -> RopeEpilogue | None:
        """:meth:`pair`'s arguments for one-position float32 heads of ``rows``
        rows, where it would apply; None otherwise."""
        if self._ops is None:
            return None
        if isinstance(offset, int):
            offset = mx.array(offset, dtype=mx.int32)
        elif not (isinstance(offset, mx.array) and offset.dtype in _ROPE_OFFSET_TYPES
                  and (offset.ndim == 0 or offset.shape == (rows,))):
            return None
        self.get(head_dim)  # (its frequencies)
        return RopeEpilogue(offset, self._freqs[head_dim], 2 * (self.dims // 2), self.traditional)

    def get(self, head_dim: int) -> Kernel:
        kernel = self._by_head.get(head_dim)
        if kernel is None:
            kernel = self._by_head[head_dim] = self._make(head_dim)
        return kernel

    def _make(self, head_dim: int) -> Kernel:
        half = self.dims // 2
        freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(self.base) / half))
        freqs = mx.repeat(freqs, 2) if self.traditional else mx.concatenate([freqs, freqs])
        freqs = mx.concatenate([freqs, mx.zeros((head_dim - 2 * half,), dtype=mx.float32)]) * self.scale
        rotate = np.zeros((head_dim, head_dim), dtype=np.float32)
        for i in range(half):
            a, b = (2 * i, 2 * i + 1) if self.traditional else (i, i + half)
            rotate[b, a], rotate[a, b] = -1.0, 1.0
        rotation = mx.array(rotate)
        mx.eval(freqs, rotation)  # constants: computed once, not in every step's graph
        self._freqs[head_dim] = freqs

        def rope(x: mx.array, offset: mx.array) -> mx.array:
            angle = offset.astype(mx.float32)
            if angle.ndim:
                angle = mx.expand_dims(angle, (1, 2, 3))
            xf = x.astype(mx.float32)
            angle = angle * freqs
            return (xf * mx.cos(angle) + (xf @ rotation) * mx.sin(angle)).astype(x.dtype)

        compiled = mx.compile(rope)
        ops = self._ops
        if ops is None:
            return compiled
        dims, traditional = 2 * half, self.traditional

        def one_operation(x: mx.array, offset: Any) -> mx.array:
            if isinstance(offset, int):
                offset = mx.array(offset, dtype=mx.int32)
            if x.dtype == mx.float32 and offset.dtype in _ROPE_OFFSET_TYPES:
                return ops.rope_decode(x, offset, freqs, dims, traditional)
            return compiled(x, offset)

        return one_operation


_ROPE_OFFSET_TYPES = (mx.int32, mx.int64, mx.uint32, mx.float32)
NO_LAYER_OPS_ENV = "AFM_NO_LAYER_OPS"


def _layer_ops() -> Any:
    """``afm_core._mlx.qmm_ext`` for its one-operation norm and decode rotary
    embedding (``ext/qmm/layer_ops.cpp``), or None (not built, or
    ``AFM_NO_LAYER_OPS=1``): then the compiled kernels above."""
    from .qmatmul import extension

    if os.environ.get(NO_LAYER_OPS_ENV, "") not in ("", "0"):
        return None
    return extension()


def wants_fusion() -> bool:
    """True when MLX computes on the CPU, where the fast kernels are missing."""
    return mx.default_device() == mx.cpu


def transposes_help() -> bool:
    """Whether MLX's products run faster on transposed weights: only with the
    reference BLAS (see ``afm_core._mlx.blas``); OpenBLAS reads either order at
    full speed and computes the output head 2x faster untransposed."""
    from .blas import blas_info

    return blas_info().name == "reference"


def fuse_cpu_kernels(model: nn.Module, *, transpose: bool | None = None) -> int:
    """Switch ``model``'s plain RMSNorm and RoPE layers to fused kernels and,
    with ``transpose`` (default: :func:`transposes_help`), its plain Linear
    layers to transposed weights and a tied output head (a model without
    ``lm_head``) to a transposed table, in place; returns how many layers
    changed."""
    if transpose is None:
        transpose = transposes_help()
    tied = not any(name.split(".")[-1] == "lm_head" for name, _ in model.named_modules())
    norms: dict[float, tuple[Kernel, Kernel]] = {}
    ropes: dict[tuple[int, bool, float, float], _RopeKernels] = {}
    changed = 0
    for _, layer in model.named_modules():
        if type(layer) is nn.Linear and transpose:
            layer.__class__ = _TransposedLinear
            layer["weight"] = mx.contiguous(layer["weight"].T)
            mx.eval(layer["weight"])
            changed += 1
            continue
        if type(layer) is nn.Embedding:
            if not transpose or not tied or layer["weight"].nbytes > TIED_HEAD_COPY_LIMIT:
                continue
            kernels: object = mx.contiguous(layer["weight"].T)
            mx.eval(kernels)
            layer.__class__ = _HeadEmbedding
        elif type(layer) is nn.RMSNorm or type(layer) in _GEMMA_NORMS:
            if layer.eps not in norms:
                norms[layer.eps] = _norm_kernels(layer.eps)
            kernels = norms[layer.eps]
            if type(layer) is nn.RMSNorm:
                layer.__class__ = _FusedRMSNorm
            else:
                layer.__class__ = _GEMMA_NORMS[type(layer)]
                object.__setattr__(layer, "_scale", None)
            object.__setattr__(layer, "_one_operation", _layer_ops() is not None)
        elif type(layer) is nn.RoPE:
            key = (layer.dims, layer.traditional, layer.base, layer.scale)
            if key not in ropes:
                ropes[key] = _RopeKernels(*key)
            kernels = ropes[key]
            layer.__class__ = _FusedRoPE
        else:
            continue
        # beside the module's dict, so the kernels never count as parameters
        object.__setattr__(layer, "_kernels", kernels)
        changed += 1
    from .activations import use_fast_swiglu  # the MLP's SwiGLU as one operation
    from .attention import use_decode_attention  # one operation per layer's decode attention
    from .decode_layout import use_decode_layout  # fewer operations per decode layer
    from .qmm_layers import use_fast_qmm  # quantized layers: afm_core._mlx.qmm_ext's products

    use_decode_attention(model)
    use_fast_swiglu(model)
    return changed + use_fast_qmm(model) + use_decode_layout(model)


def fuse_for_cpu(model: nn.Module) -> int:
    """:func:`fuse_cpu_kernels` when MLX computes on the CPU (logged); 0 elsewhere."""
    if not wants_fusion():
        return 0
    changed = fuse_cpu_kernels(model)
    log.info("CPU backend: %d norm, rotary, linear, head and decoder layers run as fused kernels,"
             " with transposed weights, through afm's quantized products or with fewer decode"
             " operations", changed)
    return changed


def unfuse_cpu_kernels(model: nn.Module) -> int:
    """Give ``model`` its plain layers back and free the kernels (their traces
    leave the calling thread's cache); returns how many layers changed."""
    changed = 0
    for _, layer in model.named_modules():
        if isinstance(layer, _TransposedLinear):
            layer["weight"] = mx.contiguous(layer["weight"].T)
            mx.eval(layer["weight"])
        elif isinstance(layer, (_FusedRMSNorm, _FusedRoPE, _HeadEmbedding)) or type(layer) in _FUSED_GEMMA_NORMS:
            object.__delattr__(layer, "_kernels")
            if isinstance(layer, _FusedRMSNorm) or type(layer) in _FUSED_GEMMA_NORMS:
                object.__delattr__(layer, "_one_operation")
            if type(layer) in _FUSED_GEMMA_NORMS:
                object.__delattr__(layer, "_scale")
        else:
            continue
        layer.__class__ = layer.__class__.__mro__[1]
        changed += 1
    from .activations import restore_swiglu
    from .attention import restore_decode_attention
    from .decode_layout import restore_decode_layout
    from .qmm_layers import restore_qmm

    restore_decode_attention(model)
    restore_swiglu(model)
    return changed + restore_qmm(model) + restore_decode_layout(model)
