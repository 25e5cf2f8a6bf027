"""Decode-time attention (one query position, or the few of a verify step) as
one MLX operation on the CPU.

On the CPU, ``mx.fast.scaled_dot_product_attention`` has no kernel of its own:
every call expands into its reference graph (a query scale, a grouped-query
reshape, two matmuls, a mask select, a softmax, and the broadcasts, flattens
and transposes between them), a dozen-odd operations per layer that MLX's
CPU scheduler runs one task at a time.  For one query position (decode), the
arithmetic is tiny and that bookkeeping is the cost: with the attention taken
out of the default model's decode step, the step ran 22% faster
(``benchmarks/decode_step.py``).

``afm_core._mlx.qmm_ext.decode_attention`` (``ext/qmm/attention_kernels.cpp``)
computes the same thing for up to ``MAX_QUERY_POSITIONS`` query positions per
(batch, head) as a single MLX primitive: float32 ``q`` (B, Hq, L, D) against
``k``/``v`` (B, Hkv, S, D), float32 or float16 (a half-precision KV cache,
widened as read), read in place (the cache's strided slices), grouped
queries, ``"causal"`` (query l sees the keys up to S - L + l) or a boolean or
additive mask broadcast to (B, Hq, L, S) (mlx-lm's batch caches pass their
left padding and the causal structure that way), the rows split over the
kernels' thread pool at long contexts.  It agrees with MLX's to float rounding
(``tests/mlx/test_attention.py``), and position l of an L-position call gives
the bits of a one-position call on the keys up to it: a speculative step's
verify forward (1 + k positions) computes exactly what the decode steps it
stands for would have.

mlx-lm's models call the ``scaled_dot_product_attention`` their module
imported from ``mlx_lm.models.base``; :func:`use_decode_attention` points that
name, in the modules of a model's layers, at :func:`scaled_dot_product_attention`
here, which takes the kernel when it applies (at most ``MAX_QUERY_POSITIONS``
query positions, float32 queries, float32 or float16 keys and values, CPU, no
quantized cache, no attention sinks) and
calls mlx-lm's function otherwise (prompts, for one).
The name is module-wide, so it is counted per module and given back
(:func:`restore_decode_attention`) when the last model using it lets go.

A quantized KV cache (``kv_bits``, a cache with ``bits``) hands mlx-lm's
attention its ``mx.quantize``'d ``(data, scales, biases)`` triples, and
mlx-lm's ``quantized_scaled_dot_product_attention`` runs two quantized
matmuls, a mask and a softmax as separate operations: decode 1.4-3x slower
than float KV.  For one query position with float32 queries and scales,
``qmm_ext.quantized_decode_attention`` (``ext/qmm/quantized_attention.cpp``)
computes it as one primitive reading the packed rows in place, masks as
mlx-lm applies them (``tests/mlx/test_quantized_attention.py``).

Prompts (more than ``MAX_QUERY_POSITIONS`` query positions) take
``qmm_ext.prefill_attention`` (``ext/qmm/prefill_attention.cpp``) instead of
MLX's reference graph, which materialises the whole (L x S) score matrix of
every head (at a 2048-token chunk on 4096 keys, 300 MB per layer, several
times over) and computes the half a causal mask hides.  The kernel is
flash-attention style: tiles of keys are unpacked once for the query heads
sharing them, their scores folded into the output with an online softmax,
and tiles the mask hides entirely skipped; float32 or float16 keys and
values, or a quantized cache's (data, scales, biases) triples; ``"causal"``,
boolean and additive masks (sliding windows arrive as boolean masks), every
head split over the kernels' thread pool; the instruction set follows the
quantized products' (``AFM_QMM_ISA``, ``qmm_ext.set_isa``: portable, AVX2,
AVX-512).  ``AFM_NO_PREFILL_ATTENTION=1`` keeps MLX's graph for prompts.
``tests/mlx/test_prefill_attention.py`` compares it with mlx-lm's attention.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as _base

from . import qmatmul as _qmm
from .reference_ops import ModuleRebinding, kernels_allowed

__all__ = ["MAX_QUERY_POSITIONS", "restore_decode_attention", "scaled_dot_product_attention",
           "use_decode_attention"]

MAX_QUERY_POSITIONS = 16
"""The most query positions the kernel takes (``ext/qmm/qmm_ext.cpp``): a
decode step, or a verify step of up to 15 guesses."""

NO_DECODE_ATTENTION_ENV = "AFM_NO_DECODE_ATTENTION"
NO_PREFILL_ATTENTION_ENV = "AFM_NO_PREFILL_ATTENTION"
_NAME = "scaled_dot_product_attention"
_original = _base.scaled_dot_product_attention


def _applies(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
             mask: Any, sinks: Any) -> bool:
    return (queries.ndim == 4 and 1 <= queries.shape[2] <= MAX_QUERY_POSITIONS and sinks is None
            and not hasattr(cache, "bits") and queries.dtype == mx.float32
            and keys.dtype == values.dtype and keys.dtype in (mx.float32, mx.float16)
            and (mask is None or isinstance(mask, str)
                 or (isinstance(mask, mx.array) and mask.dtype in (mx.bool_, mx.float32)))
            and mx.default_device() == mx.cpu)


class _QuantizedAttention(Protocol):
    """``qmm_ext.quantized_decode_attention`` (typed here, beside its one caller)."""

    def quantized_decode_attention(self, q: mx.array, keys: tuple[mx.array, ...],
                                   values: tuple[mx.array, ...], scale: float,
                                   mask: mx.array | None, group_size: int, bits: int) -> mx.array: ...


def _applies_quantized(queries: mx.array, keys: Any, values: Any, cache: Any,
                       mask: Any, sinks: Any) -> bool:
    if not (getattr(cache, "bits", None) in (4, 8) and getattr(cache, "group_size", None) in (32, 64, 128)
            and queries.ndim == 4 and queries.shape[2] == 1 and sinks is None
            and isinstance(keys, tuple | list) and isinstance(values, tuple | list)
            and len(keys) == len(values) == 3 and queries.dtype == mx.float32
            and keys[1].dtype == values[1].dtype == mx.float32
            and mx.default_device() == mx.cpu):
        return False
    if mask is None or isinstance(mask, str):
        return True
    # mlx-lm lines a 4-D mask's head axis up with the key heads (the kernel:
    # query heads), a 3-D one's first axis with the query heads per key head
    grouped = queries.shape[1] != keys[0].shape[1]
    return (isinstance(mask, mx.array) and mask.dtype in (mx.bool_, mx.float32)
            and (not grouped or mask.ndim <= 2 or (mask.ndim == 4 and mask.shape[1] == 1)))


class _PrefillAttention(Protocol):
    """``qmm_ext.prefill_attention`` (typed here, beside its one caller)."""

    def prefill_attention(self, q: mx.array, keys: list[mx.array], values: list[mx.array],
                          scale: float, mask: mx.array | None = None, causal: bool = False,
                          window: int = 0, group_size: int = 64, bits: int = 0) -> mx.array: ...
    def prefill_attention_path(self, head_dim: int = 64) -> str: ...


def _prefill_enabled() -> bool:
    return os.environ.get(NO_PREFILL_ATTENTION_ENV, "") in ("", "0")


def _applies_prefill(queries: mx.array, keys: Any, values: Any, cache: Any,
                     mask: Any, sinks: Any) -> bool:
    if not (queries.ndim == 4 and queries.shape[2] > MAX_QUERY_POSITIONS and sinks is None
            and queries.dtype == mx.float32 and mx.default_device() == mx.cpu):
        return False
    if mask is not None and not (isinstance(mask, str) and mask == "causal") and not (
            isinstance(mask, mx.array) and mask.dtype in (mx.bool_, mx.float32) and mask.ndim <= 4):
        return False
    if hasattr(cache, "bits"):
        if not (cache.bits in (4, 8) and getattr(cache, "group_size", None) in (32, 64, 128)
                and isinstance(keys, tuple | list) and isinstance(values, tuple | list)
                and len(keys) == len(values) == 3
                and keys[1].dtype == values[1].dtype == mx.float32):
            return False
        # mlx-lm lines a 4-D mask's head axis up with the key heads (the kernel: query heads)
        grouped = queries.shape[1] != keys[0].shape[1]
        return not (grouped and isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[1] != 1)
    return (isinstance(keys, mx.array) and isinstance(values, mx.array)
            and keys.dtype == values.dtype and keys.dtype in (mx.float32, mx.float16))


def _prefill(ext: Any, queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
             mask: Any) -> mx.array:
    array_mask = mask if isinstance(mask, mx.array) else None
    causal = isinstance(mask, str)
    kernel = cast(_PrefillAttention, ext)
    if hasattr(cache, "bits"):
        return kernel.prefill_attention(queries, list(keys), list(values), float(scale), array_mask,
                                        causal, 0, cache.group_size, cache.bits)
    return kernel.prefill_attention(queries, [keys], [values], float(scale), array_mask, causal)


def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array,
                                 cache: Any, scale: float, mask: Any,
                                 sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention``, through the decode kernel
    where it applies."""
    ext = _qmm.extension() if kernels_allowed() else None
    if ext is not None and _applies_prefill(queries, keys, values, cache, mask, sinks) and _prefill_enabled():
        return _prefill(ext, queries, keys, values, cache, scale, mask)
    if ext is not None and _applies_quantized(queries, keys, values, cache, mask, sinks):
        return cast(_QuantizedAttention, ext).quantized_decode_attention(
            queries, tuple(keys), tuple(values), float(scale),
            mask if isinstance(mask, mx.array) else None, cache.group_size, cache.bits)
    if ext is not None and _applies(queries, keys, values, cache, mask, sinks):
        causal = isinstance(mask, str)  # at one query position it hides nothing
        return ext.decode_attention(queries, keys, values, float(scale),
                                    None if causal else _scores_mask(mask, queries, keys.shape[2]), causal)
    return _original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def decode_heads(queries: mx.array, keys: mx.array, values: mx.array, length: int, cache: Any,
                 scale: float, mask: Any) -> mx.array | None:
    """:func:`scaled_dot_product_attention` of one query position per row
    over the first ``length`` positions of a KV cache's buffers ``keys`` and
    ``values`` (read in place: no slices of them in the graph), its output
    as (B, 1, Hq x D); None where the decode kernel does not apply (the
    caller then slices the buffers and calls the function the model uses)."""
    ext = _qmm.extension() if kernels_allowed() else None
    if ext is None or queries.shape[2] != 1 or not _applies(queries, keys, values, cache, mask, None):
        return None
    causal = isinstance(mask, str)
    return ext.decode_attention(queries, keys, values, float(scale),
                                None if causal else _scores_mask(mask, queries, length), causal,
                                length, True)


class _LastMasks(threading.local):
    """The last two masks broadcast, newest last: (mask, shape, broadcast)."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, tuple[int, ...], Any]] = []


_last_masks = _LastMasks()


def _scores_mask(mask: Any, queries: mx.array, keys: int) -> Any:
    """``mask`` broadcast to the scores' shape (B, Hq, L, S = ``keys``), as the decode
    kernel reads it.  A model passes the same mask to every layer, or two
    (Gemma 3's sliding-window layers one, its global layers another,
    interleaved), so each broadcast is made once per forward and shared
    (the kernel would otherwise add one to the graph per layer); None stays
    None."""
    if not isinstance(mask, mx.array):
        return mask
    shape = (queries.shape[0], queries.shape[1], queries.shape[2], keys)
    entries = _last_masks.entries
    for i, (held, held_shape, scores) in enumerate(entries):
        if held is mask and held_shape == shape:
            if i != len(entries) - 1:
                entries.append(entries.pop(i))
            return scores
    scores = mx.broadcast_to(mask, shape)  # (raises for a mask that does not broadcast)
    entries.append((mask, shape, scores))
    del entries[:-2]
    return scores


_REBINDING = ModuleRebinding(_NAME, _original, scaled_dot_product_attention, "_afm_attention_modules")
"""Where models point mlx-lm's ``scaled_dot_product_attention`` at this module's."""


def use_decode_attention(model: nn.Module) -> int:
    """Route the attention of ``model``'s mlx-lm modules through the decode
    kernel; returns how many modules it applies to (0 without the extension,
    off the CPU, or with ``AFM_NO_DECODE_ATTENTION=1``)."""
    if (_qmm.extension() is None or mx.default_device() != mx.cpu
            or os.environ.get(NO_DECODE_ATTENTION_ENV, "") not in ("", "0")):
        return 0
    return _REBINDING.use(model)


def restore_decode_attention(model: nn.Module) -> int:
    """Undo :func:`use_decode_attention` for ``model``: a module gets mlx-lm's
    function back when no other model uses the kernel there."""
    return _REBINDING.restore(model)
