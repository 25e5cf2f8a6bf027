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


def _plain_row(chunks: list[mx.array]) -> Any:
    row = mlx_cache.KVCache()
    for k in chunks:
        row.update_and_fetch(k.astype(mx.float16), (k + 1).astype(mx.float16))
    return row


def test_a_reserved_row_allocates_once_and_holds_what_mlx_lm_holds() -> None:
    chunks = [mx.random.normal((1, 2, n, 8)) for n in (100, 100, 100, 37)]
    (row,) = half_cache.to_half([mlx_cache.KVCache()])
    half_cache.reserve([row, mlx_cache.RotatingKVCache(max_size=8)], 337 + 256)
    buffers = []
    for k in chunks:
        row.update_and_fetch(k, k + 1)
        buffers.append(row.keys.shape[2])
    assert buffers == [768] * 4  # 593 rounded up to the 256-position step, from the first chunk on
    ref = _plain_row(chunks)
    for got, want in zip(row.keys_and_values(), ref.keys_and_values(), strict=True):
        np.testing.assert_array_equal(np.array(got), np.array(want))
    for _ in range(768 - 337):  # decoding fills the room, then mlx-lm's growth takes over
        row.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    assert row.keys.shape[2] == 768
    row.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    assert row.keys.shape[2] == 1024 and row.offset == 769


def test_a_reservation_keeps_a_cached_prefix() -> None:
    first, rest = mx.random.normal((1, 2, 40, 8)), mx.random.normal((1, 2, 300, 8))
    (row,) = half_cache.to_half([_plain_row([first])])  # a prefix cache entry, then the rest of a prompt
    half_cache.reserve([row], 340 + 10)
    row.update_and_fetch(rest, rest + 1)
    assert row.keys.shape[2] == 512
    ref = _plain_row([first, rest])
    for got, want in zip(row.keys_and_values(), ref.keys_and_values(), strict=True):
        np.testing.assert_array_equal(np.array(got), np.array(want))


def _same_batch(got: Any, want: Any) -> None:
    for a, b in zip(got.keys_and_values(), want.keys_and_values(), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert got.offset.tolist() == want.offset.tolist()
    assert got.left_padding.tolist() == want.left_padding.tolist()


def test_merging_one_row_adopts_its_buffers() -> None:
    chunk = mx.random.normal((1, 2, 300, 8))
    (row,) = half_cache.to_half([mlx_cache.KVCache()])
    half_cache.reserve([row], 300 + 256)
    row.update_and_fetch(chunk, chunk + 1)
    keys = row.keys
    batch = half_cache.KVCache.merge([row])
    assert batch.keys is keys and batch.keys.shape[2] == 768
    ref = mlx_cache.BatchKVCache.merge([_plain_row([chunk])])
    _same_batch(batch, ref)
    for i in range(5):  # decoding writes into the room, as mlx-lm's batch writes into its own
        step = mx.full((1, 2, 1, 8), float(i))
        batch.update_and_fetch(step, step)
        ref.update_and_fetch(step.astype(mx.float16), step.astype(mx.float16))
    _same_batch(batch, ref)
    assert batch.keys.shape[2] == 768


def test_merging_rows_leaves_a_step_of_room() -> None:
    chunks = [mx.random.normal((1, 2, n, 8)) for n in (30, 290)]
    rows = [half_cache.to_half([_plain_row([c])])[0] for c in chunks]
    batch = half_cache.KVCache.merge(rows)
    ref = mlx_cache.BatchKVCache.merge([_plain_row([c]) for c in chunks])
    _same_batch(batch, ref)
    assert ref.keys.shape[2] == 290 and batch.keys.shape[2] == 768  # 290 + 256, rounded up
    step = mx.ones((2, 2, 1, 8))
    batch.update_and_fetch(step, step)
    ref.update_and_fetch(step.astype(mx.float16), step.astype(mx.float16))
    _same_batch(batch, ref)
    assert batch.keys.shape[2] == 768


def test_the_only_rows_extract_is_a_view_the_batch_never_writes_into() -> None:
    chunk = mx.random.normal((1, 2, 50, 8))
    (row,) = half_cache.to_half([_plain_row([chunk])])
    batch = half_cache.BatchKVCache.merge([row])
    got = batch.extract(0)
    want = mlx_cache.BatchKVCache.merge([_plain_row([chunk])]).extract(0)
    assert type(got) is half_cache.KVCache and got.offset == want.offset == 50
    before = [np.array(x) for x in got.keys_and_values()]
    np.testing.assert_array_equal(before[0], np.array(want.keys))
    # the batch goes on: a verify step's trim, then other tokens over the same positions
    batch.trim(10)
    batch.update_and_fetch(mx.full((1, 2, 12, 8), 7.0), mx.full((1, 2, 12, 8), 7.0))
    mx.eval(batch.keys)
    for a, b in zip(got.keys_and_values(), before, strict=True):
        np.testing.assert_array_equal(np.array(a), b)
    two = half_cache.BatchKVCache.merge([half_cache.to_half([_plain_row([chunk])])[0]] * 2)
    assert two.extract(1).keys.shape == (1, 2, 50, 8)  # several rows: mlx-lm's copy


def test_the_generator_reserves_each_prompt_and_decodes_what_it_did_without(model: Any,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[(i * 7 + s) % 900 + 3 for i in range(n)] for s, n in ((1, 300), (2, 40))]
    reserved: list[int] = []
    real = half_cache.reserve

    def spy(cache: list[Any], length: int) -> None:
        reserved.append(length)
        real(cache, length)

    monkeypatch.setattr("afm_core._mlx.prefill.reserve", spy)
    tokens, first = greedy(model, prompts, kv_half=True)
    assert reserved == [300 + 12, 40 + 12]  # the prompt and max_tokens (12), below a decode step
    monkeypatch.setattr("afm_core._mlx.prefill.reserve", lambda cache, length: None)
    monkeypatch.setattr(half_cache.BatchKVCache, "merge",
                        classmethod(lambda cls, caches: mlx_cache.BatchKVCache.merge.__func__(cls, caches)))
    plain_tokens, plain_first = greedy(model, prompts, kv_half=True)
    assert tokens == plain_tokens
    for a, b in zip(first, plain_first, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
