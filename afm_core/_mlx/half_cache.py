"""A float16 KV cache for models that compute in float32 (``EngineConfig.kv_dtype``).

On the CPU afm runs quantized models with float32 activations, and mlx-lm's
caches store keys and values in the dtype they arrive in: 4 bytes per
element, twice what llama.cpp's default float16 cache holds (the default
model: 46 KiB per token, 377 MiB at its 8,192-token context).  Keys (after
the rotary embedding) and values are small numbers on the models afm serves,
well inside float16's range, and float16 keeps 11 significant bits, the
rounding llama.cpp's cache makes too.

* :class:`KVCache` / :class:`BatchKVCache`: mlx-lm's single-sequence and
  batch caches that convert what they are given to float16 before storing
  it (so a buffer never grows in another dtype), merge into and extract from
  each other (mlx-lm's ``merge`` and ``extract`` make its own classes).  They
  keep mlx-lm's class names, so the prefix cache's disk tier writes entries
  mlx-lm's ``load_prompt_cache`` reads; :func:`to_half` turns a cache read
  back (or mlx-lm's classes) into these.
* :func:`fits_half`: whether a model's keys and values fit float16 with room
  to spare, from one forward pass over a probe text (the engine's ``auto``).

Attention reads float16 keys and values as they are (``ext/qmm``'s decode
and prefill kernels widen each element exactly as they read it), so only the
rounding to float16 changes results: ``benchmarks/kv_dtype.py`` measures
greedy agreement and perplexity against the float32 cache.

**Room instead of copies.**  mlx-lm grows a cache by concatenating 256
more positions whenever it is full, a copy of everything it holds; a
prompt's prefill grows it at every chunk, the merge into a decode batch
copies each row into a buffer of exactly its length, and the batch's first
decode step grows (copies) that again.  While each copy runs, the old buffer
and the new are alive: a long prompt's peak memory was about three times its
KV cache.  Here:

* :func:`reserve` gives a row's layers the length they will reach (its
  whole prompt and a step of decoding): the first growth allocates all of it,
  once, and the chunks write into it;
* :meth:`BatchKVCache.merge` of a single row takes the row's buffers as they
  are (the row's cache is not used after the merge: the engine deep-copies
  the rows it keeps), and of several rows allocates a decode step of room;
* :meth:`BatchKVCache.extract` of the only row of a batch (a request ending
  alone) returns views of the batch's buffers instead of copies.  MLX copies
  a buffer that another array still reads before writing into it, so the
  view never sees what the batch writes afterwards.

Layers with other caches (sliding windows, recurrent state, a quantized
cache) keep theirs.

May import: mlx, mlx-lm and the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _cache

__all__ = ["DECODE_ROOM", "HALF_LIMIT", "BatchKVCache", "KVCache", "fits_half", "is_half", "reserve", "to_half"]

HALF_LIMIT = 4096.0
"""The largest |key| or |value| the probe may see for ``auto`` to choose
float16: 16x below float16's largest finite value (65504), room for inputs
larger than the probe's."""


DECODE_ROOM = 256
"""Positions of room a reservation or a merge leaves for decoding: mlx-lm's
growth step."""


def _room(cache: Any, keys: mx.array, values: mx.array, length: int, used: int) -> None:
    """Give ``cache`` buffers of ``length`` positions (rounded up to its
    ``step``) shaped like ``keys`` and ``values``, holding the first ``used``
    positions of its present ones."""
    n = -(-length // cache.step) * cache.step
    new_k = mx.zeros((*keys.shape[:2], n, keys.shape[3]), keys.dtype)
    new_v = mx.zeros((*values.shape[:2], n, values.shape[3]), values.dtype)
    if cache.keys is not None and used:
        new_k[..., :used, :] = cache.keys[..., :used, :]
        new_v[..., :used, :] = cache.values[..., :used, :]
    cache.keys, cache.values = new_k, new_v


class KVCache(_cache.KVCache):
    """mlx-lm's ``KVCache`` storing float16, growing to its reservation
    (see the module docstring)."""

    dtype = mx.float16
    reserved = 0
    """The length the buffers take at their next growth, if it is more than
    the growth needs (:func:`reserve`)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        need = self.offset + keys.shape[2]
        if self.reserved >= need and (self.keys is None or need > self.keys.shape[2]):
            _room(self, keys, values, self.reserved, self.offset)
        return super().update_and_fetch(keys, values)

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchKVCache:
        return BatchKVCache.merge(caches)


class BatchKVCache(_cache.BatchKVCache):
    """mlx-lm's ``BatchKVCache`` storing float16 (see the module docstring)."""

    dtype = mx.float16

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        return super().update_and_fetch(keys.astype(self.dtype), values.astype(self.dtype))

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> BatchKVCache:
        """mlx-lm's merge, adopting a single row's buffers and leaving room
        for decoding after several rows' (see the module docstring)."""
        if len(caches) == 1 and caches[0].keys is not None and caches[0].offset:
            row = caches[0]
            merged = cls([0])
            merged.keys, merged.values = row.keys, row.values
            merged.offset = mx.array([row.offset])
            merged._idx = row.offset
            return merged
        merged = super().merge(caches)
        merged.__class__ = BatchKVCache  # (mlx-lm's makes its own class when every row is empty)
        if merged.keys is not None:
            _room(merged, merged.keys, merged.values, merged._idx + DECODE_ROOM, merged._idx)
        return merged

    def extract(self, idx: int) -> KVCache:
        if self.keys is not None and self.keys.shape[0] == 1:
            padding = int(self.left_padding[0].item())
            row = KVCache()
            row.keys = self.keys[:, :, padding : self._idx]
            row.values = self.values[:, :, padding : self._idx]
            row.offset = self._idx - padding
            return row
        row = super().extract(idx)
        row.__class__ = KVCache
        return row


def reserve(cache: list[Any], length: int) -> None:
    """Make the float16 KV layers of ``cache`` (one row's) take ``length``
    positions at their next growth (see the module docstring); other layers
    are left as they are."""
    for c in cache:
        if isinstance(c, KVCache):
            c.reserved = length


def to_half(cache: list[Any]) -> list[Any]:
    """``cache``'s plain KV layers as float16 ones, in place (classes swapped,
    arrays converted if they hold another dtype); other layers unchanged."""
    for c in cache:
        if type(c) is _cache.KVCache:
            c.__class__ = KVCache
        elif type(c) is _cache.BatchKVCache:
            c.__class__ = BatchKVCache
        else:
            continue
        if c.keys is not None and c.keys.dtype != mx.float16:
            c.keys, c.values = c.keys.astype(mx.float16), c.values.astype(mx.float16)
    return cache


def is_half(cache: list[Any]) -> bool:
    """Whether any layer of ``cache`` is a float16 one of this module."""
    return any(isinstance(c, KVCache | BatchKVCache) for c in cache)


def fits_half(model: Any, probe: list[int]) -> bool:
    """Whether ``model`` computes in float32 and its keys and values over
    ``probe`` (token ids) stay within :data:`HALF_LIMIT` in every plain KV
    layer: then a float16 cache loses only their rounding."""
    cache = _cache.make_prompt_cache(model)
    model(mx.array(probe)[None], cache=cache)
    kv: list[tuple[mx.array, mx.array, int]] = [
        (c.keys, c.values, c.offset) for c in cache
        if type(c) is _cache.KVCache and c.keys is not None and c.values is not None]
    if not kv or any(k.dtype != mx.float32 for k, _, _ in kv):
        return False
    tops = [mx.max(mx.abs(x[..., :n, :])) for k, v, n in kv for x in (k, v)]
    top = float(mx.max(mx.stack(tops)))
    return bool(top <= HALF_LIMIT)
