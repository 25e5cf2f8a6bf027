"""``PrefixTiers`` on its own (``afm_core._engine.prefix_tiers``): the prefix
cache's memory and disk tiers as the generation thread uses them, with real
MLX KV caches (the engine-level behaviour is in test_disk_cache and
test_engine)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from afm_core import ChatRequest
from afm_core._engine.commands import Job, JobKey
from afm_core._engine.prefix_tiers import DISK_GAIN, PrefixTiers
from afm_core._mlx.prefix_cache import make_prefix_cache

REQ = ChatRequest.from_openai({"messages": [{"role": "user", "content": "hi"}]})


def job(key: int, prompt: list[int], adapter: int = 0) -> Job:
    return Job(key=JobKey(key), request=REQ, prompt=prompt, max_tokens=4, pipeline=None,  # type: ignore[arg-type]
               adapter=adapter)


def cache_of(n: int, seed: int = 0) -> list[Any]:
    """A two-layer KV cache holding ``n`` tokens."""
    mx.random.seed(seed)
    layers = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
        layers.append(c)
    mx.eval([c.state for c in layers])
    return layers


def tiers(budget: int = 1 << 30, active: int = 0) -> PrefixTiers:
    t = PrefixTiers("model", budget, active=lambda: active)
    t.memory = make_prefix_cache(max_size=256, max_bytes=budget)
    return t


def test_the_memory_tier_serves_a_prefix_and_leaves_the_rest() -> None:
    t = tiers()
    prompt = list(range(1, 11))
    t.save(prompt, cache_of(10))
    cache, rest = t.fetch_memory([*prompt, 50, 51])
    assert cache is not None and rest == [50, 51] and cache[0].offset == 10
    # an exact hit leaves the last token to compute
    cache, rest = t.fetch_memory(prompt)
    assert cache is not None and rest == [10] and cache[0].offset == 9
    # what it handed out was a copy: the entry still serves all ten tokens
    cache, rest = t.fetch_memory([*prompt, 7])
    assert cache is not None and cache[0].offset == 10
    assert t.fetch_memory([9, 9, 9]) == (None, [9, 9, 9])


def test_an_adapter_s_entries_serve_that_adapter_only() -> None:
    t = tiers()
    prompt = [3, 4, 5, 6]
    t.save(prompt, cache_of(4), adapter=2)
    assert t.key(0) == "model" and t.key(2) != t.key(1)
    assert t.fetch_memory([*prompt, 1], adapter=0)[0] is None
    assert t.fetch_memory([*prompt, 1], adapter=1)[0] is None
    assert t.fetch_memory([*prompt, 1], adapter=2)[1] == [1]


def test_no_budget_no_memory_tier() -> None:
    t = tiers(budget=0)
    assert not t.caching
    t.save([1, 2, 3], cache_of(3))
    assert len(t.memory) == 0 and t.fetch_memory([1, 2, 3, 4]) == (None, [1, 2, 3, 4])


def test_the_budget_counts_the_running_batch() -> None:
    one = sum(c.nbytes for c in cache_of(16))
    t = tiers(budget=3 * one)
    for n in range(3):
        t.save([100 + n, *range(15)], cache_of(16, seed=n))
    assert len(t.memory) == 3 and t.counts.memory_bytes == t.memory.nbytes > 0
    busy = tiers(budget=3 * one, active=2 * one)  # the batch holds two entries' worth
    for n in range(3):
        busy.save([100 + n, *range(15)], cache_of(16, seed=n))
    assert len(busy.memory) == 1
    assert busy.fetch_memory([102, *range(15), 1])[0] is not None  # the newest stayed


def test_pins_survive_the_eviction_that_follows() -> None:
    one = sum(c.nbytes for c in cache_of(8))
    t = tiers(budget=int(1.5 * one))
    t.save([1, *range(7)], cache_of(8), pins=((8, 60.0),))
    t.save([2, *range(7)], cache_of(8, seed=1))
    assert t.memory.pinned(t.key(0), [1, *range(7)])
    assert t.fetch_memory([1, *range(7), 9])[0] is not None
    assert t.fetch_memory([2, *range(7), 9])[0] is None  # the unpinned one went


def test_lookups_are_counted_by_tier() -> None:
    t = tiers()
    hit, miss = job(1, [1, 2, 3]), job(2, [4, 5, 6])
    hit.cached_tokens = 2
    t.count(hit, "memory")
    t.count(miss, "memory")  # no disk tier: not a disk miss either
    hit.cached_tokens = 1
    t.count(hit, "disk")
    c = t.counts
    assert (c.hits, c.memory_hits, c.disk_hits, c.disk_misses) == (2, 1, 1, 0)


def _until(done: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_disk_tier_serves_what_the_memory_tier_lost(tmp_path: Path) -> None:
    woke = threading.Event()
    prompt = list(range(1, 41))
    first = tiers()
    first.open_disk(tmp_path, 1 << 30, "fp", wake=woke.set)
    assert first.disk is not None and first.caching
    first.save(prompt, cache_of(40))
    _until(lambda: list(first.poll_disk()) == [] and len(first.disk or ()) == 1, "the write lands")
    first.close()

    t = tiers()  # a new process: the same directory, an empty memory tier
    t.open_disk(tmp_path, 1 << 30, "fp", wake=woke.set)
    waiting = job(1, [*prompt, 99])
    assert t.read_disk(waiting) and t.loading == {JobKey(1): (waiting, t.loading[JobKey(1)][1])}
    ready: list[Any] = []
    _until(lambda: ready.extend(t.poll_disk()) or ready, "the read finishes")
    [(got, match, cache)] = ready
    assert got is waiting and match.served == 40 and cache is not None and cache[0].offset == 40
    assert not t.loading
    assert mx.array_equal(cache[0].state[0], cache_of(40)[0].state[0])
    # promoted: the memory tier now serves it, and the disk tier is not worth reading again
    assert t.fetch_memory([*prompt, 7])[1] == [7]
    assert not t.read_disk(job(2, [*prompt, 5]))
    t.count(waiting, "disk")
    t.close()


def test_a_small_gain_from_a_long_entry_is_not_read(tmp_path: Path) -> None:
    prompt = list(range(1, 41))
    t = tiers(budget=0)  # disk only
    t.open_disk(tmp_path, 1 << 30, "fp", wake=lambda: None)
    t.save(prompt, cache_of(40))
    _until(lambda: list(t.poll_disk()) == [] and len(t.disk or ()) == 1, "the write lands")
    short = 40 // DISK_GAIN - 1  # the entry's first tokens only: not worth 40 tokens' read
    assert not t.read_disk(job(1, [*prompt[:short], 500, 501]))
    assert t.read_disk(job(2, [*prompt[:40 // DISK_GAIN], 500]))
    miss = job(3, [7, 7, 7])
    t.count(miss, "memory")
    assert t.counts.disk_misses == 1
    t.close()
