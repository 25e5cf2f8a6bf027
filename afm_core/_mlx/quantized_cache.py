"""A quantized KV cache that batches: ``EngineConfig.kv_bits``.

mlx-lm stores a quantized KV cache in ``QuantizedKVCache``: each layer's keys
and values as ``mx.quantize``'d ``(data, scales, biases)`` triples (``bits``
per element, one scale and bias per ``group_size`` elements of a head's
vector), and its attention (``mlx_lm.models.base.scaled_dot_product_attention``)
switches to ``quantized_scaled_dot_product_attention`` for any cache with a
``bits`` attribute.  Its continuous batcher only knows float caches
(``BatchKVCache``), and ``mlx_lm.server`` quantizes the cache only without
batching.  This module gives the batcher the quantized pair:

* :class:`QuantizedKVCache`: mlx-lm's single-sequence cache plus what a
  batched row needs (``size()``, ``merge`` into a batch cache, an ``nbytes``
  that allows an empty cache).  A row is prefilled on it (afm's prefill runs
  each prompt on its own cache, :mod:`.prefill`), the prefix cache's tiers
  keep it, and a batch row is extracted as one.  It keeps mlx-lm's class name
  so an entry file names it as mlx-lm's ``load_prompt_cache`` expects
  (:func:`.cache_file.build_cache` builds this subclass from that name).
* :class:`BatchQuantizedKVCache`: mlx-lm's ``BatchKVCache`` (left-padded
  rows, ``offset`` per row, one write index ``_idx``) with every array a
  triple: the same operations (``update_and_fetch``, ``prepare``/``finalize``
  with right padding rolled to the left, ``filter``, ``extend``, ``extract``,
  ``merge``, ``make_mask``, ``trim``, ``state``), each applied to the three
  parts.  Padding positions hold zero data, scales and biases (they
  dequantize to 0) and are masked out as in mlx-lm's.

Keys and values are quantized from the first token (mlx-lm's generate has a
``quantized_kv_start`` that keeps the first tokens in float and converts the
whole cache later; with continuous batching every row would then switch at
another step, so the engine does not: one cache format per engine).

May import: mlx, mlx-lm and the standard library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _cache
from mlx_lm.models.base import create_causal_mask

__all__ = ["KV_BITS", "KV_GROUP_SIZES", "BatchQuantizedKVCache", "QuantizedKVCache", "check_quantizable",
           "make_quantized_cache"]

KV_BITS = (4, 8)
"""The ``kv_bits`` values the engine accepts."""
KV_GROUP_SIZES = (32, 64, 128)
"""The ``kv_group_size`` values ``mx.quantize`` accepts."""

Parts = tuple[mx.array, ...]
"""One quantized array: ``(data, scales, biases)``, each (B, heads, positions, *)."""


def _map(fn: Callable[[mx.array], mx.array], *parts: Parts) -> tuple[Parts, ...]:
    return tuple(tuple(fn(x) for x in p) for p in parts)


def _zeros(shape: tuple[int, int, int], dim: int, dtype: mx.Dtype, group_size: int, bits: int) -> Parts:
    """An all-zero quantized array of ``dim`` elements per position (as mlx-lm's ``init_quant``)."""
    per_word = 32 // bits
    return (mx.zeros((*shape, dim // per_word), dtype=mx.uint32),
            mx.zeros((*shape, dim // group_size), dtype=dtype),
            mx.zeros((*shape, dim // group_size), dtype=dtype))


class QuantizedKVCache(_cache.QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` as a row of a batch (see the module docstring)."""

    def size(self) -> int:
        return int(self.offset)

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))


def make_quantized_cache(model: Any, *, bits: int, group_size: int) -> list[Any]:
    """A fresh single-sequence cache for ``model``: one :class:`QuantizedKVCache` per layer."""
    return [QuantizedKVCache(group_size=group_size, bits=bits) for _ in _cache.make_prompt_cache(model)]


def check_quantizable(model: Any, group_size: int) -> None:
    """Raise ValueError, saying why, when ``model``'s KV cache cannot be
    quantized: a layer whose cache is not mlx-lm's plain ``KVCache`` (a sliding
    window, a recurrent state), or a head size ``group_size`` does not divide."""
    caches = _cache.make_prompt_cache(model)
    others = sorted({type(c).__name__ for c in caches if type(c) is not _cache.KVCache})
    if others:
        raise ValueError(f"kv_bits: this model's cache has layers of type {', '.join(others)}, "
                         "which mlx-lm cannot quantize (only KVCache layers)")
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", 0) or 0
    hidden = getattr(args, "hidden_size", 0) or 0
    head_dim = getattr(args, "head_dim", None) or (hidden // heads if heads else 0)
    if head_dim and head_dim % group_size:
        raise ValueError(f"kv_bits: the model's head size {head_dim} is not a multiple of "
                         f"kv_group_size {group_size} (try {' or '.join(str(g) for g in KV_GROUP_SIZES if head_dim % g == 0) or 'float KV'})")


class BatchQuantizedKVCache(_cache._BaseCache):
    """mlx-lm's ``BatchKVCache`` storing quantized triples (see the module
    docstring).  ``bits`` and ``group_size`` make mlx-lm's attention take its
    quantized path."""

    step = 256

    def __init__(self, left_padding: list[int], *, group_size: int = 64, bits: int = 8) -> None:
        self.keys: Parts | None = None
        self.values: Parts | None = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        B, H, T, Dk = keys.shape
        Dv = values.shape[3]
        prev = self._idx
        if self.keys is None or self.values is None or prev + T > self.keys[0].shape[2]:
            shape = (B, H, (self.step + T - 1) // self.step * self.step)
            new_k = _zeros(shape, Dk, keys.dtype, self.group_size, self.bits)
            new_v = _zeros(shape, Dv, values.dtype, self.group_size, self.bits)
            if self.keys is not None and self.values is not None:
                if prev % self.step != 0:
                    self.keys, self.values = _map(lambda x: x[..., :prev, :], self.keys, self.values)
                self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(self.keys, new_k, strict=True))
                self.values = tuple(mx.concatenate([a, b], axis=2)
                                    for a, b in zip(self.values, new_v, strict=True))
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + T
        self._idx += T
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev:self._idx, :] = qk[i]
            self.values[i][..., prev:self._idx, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Parts, Parts]:
        assert self.keys is not None and self.values is not None
        idx = self._idx
        k, v = _map(lambda x: x[..., :idx, :], self.keys, self.values)
        return k, v

    def prepare(self, *, left_padding: list[int] | None = None, lengths: Any = None,
                right_padding: list[int] | None = None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty BatchQuantizedKVCache")
            pad = mx.array(left_padding)
            self.left_padding += pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        padding = self._right_padding
        if padding is not None:
            if self.keys is not None and self.values is not None:
                self.keys, self.values = _map(lambda x: _cache.dynamic_roll(x, padding[:, None], axis=2),
                                              self.keys, self.values)
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    @property
    def meta_state(self) -> tuple[str, str]:
        return str(self.group_size), str(self.bits)

    @meta_state.setter
    def meta_state(self, v: tuple[str, str]) -> None:
        self.group_size, self.bits = int(v[0]), int(v[1])

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: list[int]) -> None:
        """Keep the rows ``batch_indices`` (in place), then drop the padding
        columns every row left has (as mlx-lm's)."""
        if self.keys is not None and self.values is not None:
            self.keys, self.values = _map(lambda x: x[batch_indices], self.keys, self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        pads: list[int] = self.left_padding.tolist()  # type: ignore[assignment]  # 1-D: a list of ints
        least = min(pads)
        if least > 0:
            if self.keys is not None and self.values is not None:
                self.keys, self.values = _map(lambda x: x[..., least:, :], self.keys, self.values)
            self._idx -= least
            self.left_padding -= least

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append ``other``'s rows (in place): both right-aligned to the longer write index."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other
        like_k, like_v = like.keys, like.values
        assert like_k is not None and like_v is not None
        H = like_k[0].shape[1]

        def pad(c: BatchQuantizedKVCache) -> tuple[Parts, Parts, mx.array, mx.array]:
            k, v = c.keys, c.values
            if k is None or v is None:
                rows = c.offset.shape[0]
                k, v = _map(lambda x: mx.zeros((rows, H, 0, x.shape[3]), dtype=x.dtype), like_k, like_v)
            left = idx - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k, v = _map(lambda x: x[..., :right, :], k, v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = _map(lambda x: mx.pad(x, widths), k, v)
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2, strict=True))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2, strict=True))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row ``idx`` as a single-sequence :class:`QuantizedKVCache` (its own copy)."""
        cache: Any = QuantizedKVCache(group_size=self.group_size, bits=self.bits)  # mlx-lm's fields: untyped
        mx.eval(self.left_padding)
        start: int = self.left_padding.tolist()[idx]  # type: ignore[index, assignment]  # 1-D: a list of ints
        end = self._idx
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        cache.keys, cache.values = _map(lambda x: mx.contiguous(x[idx:idx + 1, :, start:end]), keys, values)
        cache.offset = end - start
        return cache  # type: ignore[no-any-return]

    @classmethod
    def merge(cls, rows: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """One batch cache of single-sequence ``rows``, each right-aligned
        (left padding before the shorter ones)."""
        caches: list[Any] = list(rows)  # mlx-lm's fields: untyped
        first = caches[0]
        group_size, bits = first.group_size, first.bits
        if any(c.group_size != group_size or c.bits != bits for c in caches):
            raise ValueError("cannot batch quantized caches of different bits or group sizes")
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), group_size=group_size, bits=bits)
        padding = [longest - n for n in lengths]
        full = [c for c in caches if c.keys is not None and c.size() > 0]
        H = full[0].keys[0].shape[1]
        shape = (len(caches), H, longest)
        dtype = full[0].keys[1].dtype
        # the element counts per position, back from the packed words
        dk = full[0].keys[0].shape[3] * 32 // bits
        dv = full[0].values[0].shape[3] * 32 // bits
        keys = _zeros(shape, dk, dtype, group_size, bits)
        values = _zeros(shape, dv, dtype, group_size, bits)
        for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
            n = lengths[i]
            if c.keys is None or n == 0:
                continue
            for j in range(3):
                keys[j][i:i + 1, :, p:p + n] = c.keys[j][..., :n, :]
                values[j][i:i + 1, :, p:p + n] = c.values[j][..., :n, :]
        cache = cls(padding, group_size=group_size, bits=bits)
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache._idx = longest
        return cache

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))
