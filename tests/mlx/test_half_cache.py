"""afm_core._mlx.half_cache: a float16 KV cache for float32 models.

Rows store float16 from their first token, merge into a float16 batch cache,
grow, filter and extract without ever turning float32; the engine's batch
generator decodes the same greedy tokens as with mlx-lm's float32 cache on a
model whose keys and values float16 holds to 11 bits (the tiny random model's
logits move by a few thousandths of their range, far less than greedy margins
on most steps: the test asserts close logits and mostly equal tokens, what
the float16 rounding allows).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache

from afm_core._mlx import half_cache
from afm_core._mlx.fusion import fuse_for_cpu, unfuse_cpu_kernels
from afm_core._mlx.prefill import EngineBatchGenerator


@pytest.fixture(scope="module")
def model(random_model_dir: Path) -> Any:
    import mlx_lm

    m = mlx_lm.load(str(random_model_dir))[0]
    fuse_for_cpu(m)
    yield m
    unfuse_cpu_kernels(m)


def test_rows_store_float16_through_growth_merge_filter_and_extract() -> None:
    rows = [half_cache.to_half([mlx_cache.KVCache()]) for _ in range(3)]
    for n, row in zip((3, 300, 17), rows, strict=True):  # 300: past a 256-position step
        k = mx.random.normal((1, 2, n, 8))
        keys, values = row[0].update_and_fetch(k, k + 1)
        assert keys.dtype == values.dtype == mx.float16
        np.testing.assert_array_equal(np.array(keys), np.array(k.astype(mx.float16)))
    batch = half_cache.KVCache.merge([r[0] for r in rows])
    assert type(batch) is half_cache.BatchKVCache and batch.keys.dtype == mx.float16
    for _ in range(300):  # decode steps, past another step of the buffer
        keys, _ = batch.update_and_fetch(mx.ones((3, 2, 1, 8)), mx.ones((3, 2, 1, 8)))
    assert keys.dtype == mx.float16 and batch.keys.dtype == mx.float16
    batch.filter([0, 2])
    row = batch.extract(1)
    assert type(row) is half_cache.KVCache and row.keys.dtype == mx.float16 and row.offset == 17 + 300
    assert type(copy.deepcopy(row)) is half_cache.KVCache
    empty = half_cache.KVCache.merge([half_cache.KVCache(), half_cache.KVCache()])
    assert type(empty) is half_cache.BatchKVCache
    # an entry read back from disk is mlx-lm's class: made float16 again
    plain = mlx_cache.KVCache()
    plain.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)))
    (made,) = half_cache.to_half([plain])
    assert type(made) is half_cache.KVCache and made.keys.dtype == mx.float16
    assert half_cache.is_half([made]) and not half_cache.is_half([mlx_cache.KVCache()])


def test_the_probe(model: Any) -> None:
    assert half_cache.fits_half(model, list(range(3, 60)))
    half = model.model.layers[0].self_attn.v_proj
    saved = half.weight
    try:  # values far beyond float16's comfort
        half.weight = half.weight * 0 + 1e5 if half.weight.dtype != mx.uint32 else half.weight
        if half.weight.dtype != mx.uint32:
            assert not half_cache.fits_half(model, list(range(3, 60)))
    finally:
        half.weight = saved


def greedy(model: Any, prompts: list[list[int]], kv_half: bool) -> tuple[list[list[int]], list[mx.array]]:
    gen = EngineBatchGenerator(model, logprob_uids=set(), stop_tokens=[], kv_half=kv_half,
                               completion_batch_size=4, prefill_batch_size=2, prefill_step_size=64)
    uids = [gen.insert_one(p, max_tokens=12, cache=None, all_tokens=[], sampler=None, logits_processors=[])
            for p in prompts]
    out: dict[int, list[int]] = {u: [] for u in uids}
    first: dict[int, mx.array] = {}
    while any(len(t) < 12 for t in out.values()):
        _, responses = gen.next()
        for r in responses:
            if r.uid not in first:
                first[r.uid] = r.logprobs
            out[r.uid].append(r.token)
    caches = [c for c in gen._generation_batch.prompt_cache]
    gen.close()
    if kv_half:
        assert all(type(c) is half_cache.BatchKVCache for c in caches) or not caches
    return [out[u] for u in uids], [first[u] for u in uids]


def test_greedy_decoding_close_to_float32(model: Any) -> None:
    prompts = [[(i * 13 + s) % 900 + 3 for i in range(n)] for s, n in ((1, 150), (2, 40), (3, 300), (4, 9))]
    ref_tokens, ref_first = greedy(model, prompts, kv_half=False)
    tokens, first = greedy(model, prompts, kv_half=True)
    # the first token's log-probabilities: the prompt's attention over float16 keys and values
    for a, b in zip(ref_first, first, strict=True):
        assert float(mx.max(mx.abs(a - b))) <= 1e-2 * float(mx.max(mx.abs(a)))
    same = sum(x == y for r, t in zip(ref_tokens, tokens, strict=True) for x, y in zip(r, t, strict=True))
    assert same >= 0.75 * sum(map(len, ref_tokens))
