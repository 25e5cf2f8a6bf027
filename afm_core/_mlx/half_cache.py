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

Layers with other caches (sliding windows, recurrent state, a quantized
cache) keep theirs.

May import: mlx, mlx-lm and the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _cache

__all__ = ["HALF_LIMIT", "BatchKVCache", "KVCache", "fits_half", "is_half", "to_half"]

HALF_LIMIT = 4096.0
"""The largest |key| or |value| the probe may see for ``auto`` to choose
float16: 16x below float16's largest finite value (65504), room for inputs
larger than the probe's."""


class KVCache(_cache.KVCache):
    """mlx-lm's ``KVCache`` storing float16 (see the module docstring)."""

    dtype = mx.float16

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        return super().update_and_fetch(keys.astype(self.dtype), values.astype(self.dtype))

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
        merged = super().merge(caches)
        merged.__class__ = BatchKVCache  # (mlx-lm's makes its own class when every row is empty)
        return merged

    def extract(self, idx: int) -> KVCache:
        row = super().extract(idx)
        row.__class__ = KVCache
        return row


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
