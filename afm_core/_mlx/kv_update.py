"""A decode step's write of one position's keys and values into a KV cache,
and the positions the cache's buffers then hold (for an attention that
reads them in place): the cache side of :mod:`.decode_layout` and
:mod:`.decode_plan`."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _cache

from . import half_cache
from . import qmatmul as _qmm

__all__ = ["filled_positions", "rotating_write", "update_and_fetch"]


def update_and_fetch(cache: Any, keys: mx.array, values: mx.array, *, fetch: bool = True) -> Any:
    """``cache.update_and_fetch(keys, values)``; for a float16 cache
    (:mod:`.half_cache`) with room for them, each buffer's cast and slice
    update as one operation (``qmm_ext.kv_write``: the same float16 values,
    written in place when nothing else holds the buffer, as a slice update
    writes it).  ``fetch`` False: that path returns None instead of the
    slices of the buffers (the caller reads the buffers in place)."""
    ext = _qmm.extension()
    batch = type(cache) is half_cache.BatchKVCache
    if (ext is None or not (batch or type(cache) is half_cache.KVCache) or cache.keys is None
            or keys.dtype != mx.float32 or values.dtype != mx.float32):
        return cache.update_and_fetch(keys, values)
    n = keys.shape[2]
    prev = cache._idx if batch else cache.offset
    if prev + n > cache.keys.shape[2]:
        return cache.update_and_fetch(keys, values)  # (it grows the buffers)
    ext.kv_write(cache.keys, keys, prev)  # (the array objects change, as with `a[...] = x`)
    ext.kv_write(cache.values, values, prev)
    if batch:
        cache.offset = cache.offset + n
        cache._idx += n
    else:
        cache.offset += n
    return cache.keys_and_values() if fetch else None


_PLAIN_SINGLE = (_cache.KVCache, half_cache.KVCache)
_PLAIN_BATCH = (_cache.BatchKVCache, half_cache.BatchKVCache)


def rotating_write(cache: Any, keys: mx.array, values: mx.array) -> bool:
    """mlx-lm's ``BatchRotatingKVCache`` update by one position where it only
    writes at its index and advances (no growth, trim or rotation: else
    False, and mlx-lm's update runs), without the ``mx.depends`` that ties
    the layer's new ``offset`` to its keys, for a layer whose offset
    :func:`.batch.share_offsets` shares with the batch's first rotating
    layer: the addition is then dropped unevaluated at the next share (the
    first layer's, the same values, is read), three operations fewer."""
    size = cache.keys.shape[2] if cache.keys is not None else 0
    if (keys.shape[2] != 1 or cache._lengths is not None or cache.rotated or not size
            or size > cache.max_size or cache._idx >= cache.max_size
            or (cache._offset >= size and size < cache.max_size)):
        return False
    i = cache._idx
    cache.keys[..., i:i + 1, :] = keys
    cache.values[..., i:i + 1, :] = values
    cache._offset += 1
    cache.offset = cache.offset + 1
    cache._idx += 1
    return True


def filled_positions(cache: Any) -> int | None:
    """The positions a plain KV cache (mlx-lm's or :mod:`.half_cache`'s)
    holds, the first of its buffers; for mlx-lm's rotating caches after an
    update, the first positions of its buffers its ``keys_and_values``
    returns (a slice of them until the window is full, then the whole
    buffers, in the order the rotation left them); None for other caches."""
    kind = type(cache)
    if kind in _PLAIN_BATCH:
        return int(cache._idx)
    if kind in _PLAIN_SINGLE:
        return int(cache.offset)
    if kind is _cache.RotatingKVCache:
        return min(int(cache.offset), int(cache.keys.shape[2]))
    if kind is _cache.BatchRotatingKVCache:
        return min(int(cache._offset), int(cache.keys.shape[2]))
    return None
