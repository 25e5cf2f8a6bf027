"""The prefix cache's disk tier below the engine: the entry file
(``afm_core._mlx.cache_file``: mlx-lm's prompt-cache format, checksummed)
and the index with its I/O thread (``afm_core._mlx.disk_cache``)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, load_prompt_cache

from afm_core._mlx.cache_file import (
    CorruptEntry,
    build_cache,
    encode_cache,
    read_entry,
    read_header,
    write_entry,
)
from afm_core._mlx.disk_cache import DiskPromptCache, Loaded

FIELDS = {"model": "m", "tokens": json.dumps([5, 6, 7]), "trimmable": "1"}


def kv(n: int, dtype: Any = mx.float32, seed: int = 0) -> KVCache:
    mx.random.seed(seed)
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, n, 8)).astype(dtype), mx.random.normal((1, 2, n, 8)).astype(dtype))
    return c


def mixed() -> list[Any]:
    rot = RotatingKVCache(max_size=8, keep=2)
    rot.update_and_fetch(mx.random.normal((1, 2, 5, 8)).astype(mx.bfloat16),
                         mx.random.normal((1, 2, 5, 8)).astype(mx.bfloat16))
    q = QuantizedKVCache(group_size=32, bits=4)
    q.update_and_fetch(mx.random.normal((1, 2, 7, 32)), mx.random.normal((1, 2, 7, 32)))
    cache = [kv(10), rot, q]
    mx.eval([c.state for c in cache])
    return cache


def same_state(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, mx.array):
        return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b))
    return bool(a == b)


def write(path: Path, cache: list[Any], **fields: str) -> int:
    return write_entry(path, *encode_cache(cache), {**FIELDS, **fields})


def test_an_entry_round_trips_and_mlx_lm_reads_it(tmp_path: Path) -> None:
    cache = mixed()
    path = tmp_path / "e.safetensors"
    size = write(path, cache)
    assert size == path.stat().st_size
    head = read_header(path)
    assert (head.tokens, head.model, head.trimmable, head.size) == ((5, 6, 7), "m", True, size)
    back = build_cache(*read_entry(path)[1:])
    # mlx-lm's QuantizedKVCache comes back as afm's batchable subclass of it (same name)
    assert [type(c).__name__ for c in back] == [type(c).__name__ for c in cache]
    assert all(isinstance(b, type(a)) for a, b in zip(cache, back, strict=True))
    assert all(same_state(a.state, b.state) for a, b in zip(cache, back, strict=True))
    # the same format as mlx-lm's save_prompt_cache: its loader reads the file
    theirs, meta = load_prompt_cache(str(path), return_metadata=True)
    assert all(same_state(a.state, b.state) for a, b in zip(cache, theirs, strict=True))
    assert json.loads(meta["tokens"]) == [5, 6, 7] and meta["checksum"].startswith("sha256:")
    assert not list(tmp_path.glob("*.tmp"))


def test_a_sliced_array_is_written_as_its_values(tmp_path: Path) -> None:
    c = kv(20)
    c.keys, c.values = c.keys[:, :, 3:9], c.values[:, :, 3:9]  # not contiguous
    c.offset = 6
    path = tmp_path / "s.safetensors"
    write(path, [c])
    (back,) = build_cache(*read_entry(path)[1:])
    assert same_state(back.state, (c.keys, c.values, 6))


@pytest.mark.parametrize("where", ["length", "header", "tensors", "tail"])
def test_every_altered_or_truncated_file_is_refused(tmp_path: Path, where: str) -> None:
    path = tmp_path / "e.safetensors"
    write(path, mixed())
    data = path.read_bytes()
    (n,) = np.frombuffer(data[:8], dtype="<u8")
    spans = {"length": range(0, 8), "header": range(8, 8 + int(n)), "tensors": range(8 + int(n), len(data)),
             "tail": range(len(data) - 64, len(data))}
    positions = list(spans[where])
    for at in positions[:: max(len(positions) // 60, 1)]:
        altered = bytearray(data)
        altered[at] ^= 0xFF
        path.write_bytes(bytes(altered))
        with pytest.raises((CorruptEntry, KeyError)):
            read_entry(path)
    for cut in (0, 4, 8, int(n) // 2, 8 + int(n), len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptEntry):
            read_header(path)
        with pytest.raises(CorruptEntry):
            read_entry(path)


def test_bytes_of_an_array_being_evaluated_are_read_on_another_thread(tmp_path: Path) -> None:
    """What the I/O thread relies on: an array scheduled with mx.async_eval on
    this thread's stream is read (waited for) from another thread; an array
    never evaluated is not (no stream there)."""
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        a = mx.random.normal((512, 512))
        for _ in range(4):
            a = a @ a / 20
        mx.async_eval(a)
        unevaluated = a + 1
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(np.array(memoryview(a))))
    t.start()
    t.join()
    assert np.array_equal(got[0], np.array(a))

    def touch() -> None:
        try:
            memoryview(unevaluated)
        except RuntimeError as exc:
            got.append(exc)

    t = threading.Thread(target=touch)
    t.start()
    t.join()
    assert isinstance(got[-1], RuntimeError)


def poll_until(disk: DiskPromptCache, pred: Any, limit: float = 10.0) -> list[Loaded]:
    loaded: list[Loaded] = []
    deadline = time.monotonic() + limit
    while True:
        loaded += disk.poll()
        if pred(loaded):
            return loaded
        assert time.monotonic() < deadline, "the I/O thread did not finish"
        time.sleep(0.002)


def saved(disk: DiskPromptCache, tokens: list[int], seed: int = 0) -> None:
    before = disk.stats.writes
    cache = [kv(len(tokens), seed=seed)]
    mx.eval([c.state for c in cache])
    disk.save(tokens, cache, trimmable=True)
    poll_until(disk, lambda _: disk.stats.writes > before)


def test_the_index_matches_as_the_memory_tier_and_survives_a_restart(tmp_path: Path) -> None:
    disk = DiskPromptCache(tmp_path, 1 << 30, "fp")
    try:
        saved(disk, [1, 2, 3, 4, 5, 6])
        m = disk.nearest([1, 2, 3, 4, 5, 6])
        assert m is not None and m.served == 6  # exact
        m = disk.nearest([1, 2, 3, 9])
        assert m is not None and m.served == 3  # longer, trimmed to the common part
        m = disk.nearest([1, 2, 3, 4, 5, 6, 7, 8])
        assert m is not None and m.served == 6  # shorter
        assert disk.nearest([2, 3]) is None
        saved(disk, [1, 2, 3, 4, 5, 6, 7, 8], seed=1)  # covers its prefix: that one goes
        assert len(disk) == 1
        m = disk.nearest([1, 2, 3])
        assert m is not None and m.served == 2 and disk.load(m.entry)
        (loaded,) = poll_until(disk, lambda got: got)
        assert loaded.cache is not None and loaded.cache[0].offset == 8
        assert same_state(loaded.cache[0].state[:2], kv(8, seed=1).state[:2])
    finally:
        disk.close()
    assert len(list(tmp_path.glob("afmkv-*"))) == 1
    again = DiskPromptCache(tmp_path, 1 << 30, "fp")
    other = DiskPromptCache(tmp_path, 1 << 30, "another model")
    try:
        assert len(again) == 1 and again.nearest([1, 2, 3, 4, 5, 6, 7, 8]) is not None
        assert len(other) == 0 and other.nearest([1, 2, 3]) is None
    finally:
        again.close()
        other.close()


def test_adapted_entries_are_keyed_by_the_adapters_content(tmp_path: Path) -> None:
    disk = DiskPromptCache(tmp_path, 1 << 30, "fp", adapters=["fox weights", "zebra weights"])
    try:
        saved(disk, [1, 2, 3, 4])  # the base model's
        before = disk.stats.writes
        cache = [kv(4, seed=1)]
        mx.eval([c.state for c in cache])
        disk.save([1, 2, 3, 4], cache, trimmable=True, adapter=1)  # the same tokens under adapter 1
        poll_until(disk, lambda _: disk.stats.writes > before)
        assert len(disk) == 2
        for adapter, seed in ((0, 0), (1, 1)):
            m = disk.nearest([1, 2, 3, 4], adapter)
            assert m is not None and m.entry.adapter == adapter and disk.load(m.entry)
            (loaded,) = poll_until(disk, lambda got: got)
            assert loaded.cache is not None and same_state(loaded.cache[0].state[:2], kv(4, seed=seed).state[:2])
        assert disk.nearest([1, 2, 3, 4], 2) is None and disk.nearest([1, 2, 3, 4], 7) is None
    finally:
        disk.close()
    # a restart: the same content under other indices is found; other content is another model's
    cases = {("zebra weights", "fox weights"): 2, ("fox weights",): 1, ("other weights",): 0, (): 0}
    for adapters, index in cases.items():
        again = DiskPromptCache(tmp_path, 1 << 30, "fp", adapters=adapters)
        try:
            assert len(again) == (2 if index else 1)
            assert again.nearest([1, 2, 3, 4]) is not None  # the base model's keeps its fingerprint
            m = again.nearest([1, 2, 3, 4], index) if index else None
            assert (m is not None and m.entry.adapter == index) if index else all(
                again.nearest([1, 2, 3, 4], i) is None for i in range(1, len(adapters) + 1))
        finally:
            again.close()


def test_the_budget_and_the_order_of_use(tmp_path: Path) -> None:
    disk = DiskPromptCache(tmp_path, 1 << 30, "fp")
    saved(disk, [1] * 50)
    one = disk.stats.bytes
    disk.close()
    for f in tmp_path.iterdir():
        f.unlink()
    disk = DiskPromptCache(tmp_path, int(one * 2.5), "fp")
    try:
        saved(disk, [1] * 50)
        saved(disk, [2] * 50)
        m = disk.nearest([1] * 50)
        assert m is not None and disk.load(m.entry)
        poll_until(disk, lambda got: got)
        saved(disk, [3] * 50)  # over the budget: [2]*50 is the least recently used
        assert disk.nearest([2] * 50) is None and disk.stats.evictions == 1
        assert disk.nearest([1] * 50) is not None and disk.nearest([3] * 50) is not None
    finally:
        disk.close()
    assert sum(f.stat().st_size for f in tmp_path.glob("afmkv-*")) <= one * 2.5
    # the order of use survives a restart (the files' times): [1]*50 was read after [2]... and [3] last
    os.utime(next(tmp_path.glob("afmkv-*")), (1, 1))  # make one of them the oldest
    oldest = min(tmp_path.glob("afmkv-*"), key=lambda f: f.stat().st_mtime_ns)
    disk = DiskPromptCache(tmp_path, int(one * 1.5), "fp")
    try:
        assert len(disk) == 1 and not oldest.exists()
    finally:
        disk.close()


def test_a_longer_write_drops_the_pending_writes_of_its_prefixes(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from afm_core._mlx import disk_cache

    gate, started = threading.Event(), threading.Event()
    real = disk_cache.write_entry

    def held_write(*args: Any) -> int:
        started.set()
        gate.wait(10)
        return real(*args)

    monkeypatch.setattr(disk_cache, "write_entry", held_write)
    disk = DiskPromptCache(tmp_path, 1 << 30, "fp")
    try:
        for n in (10, 20, 30):
            c = [kv(n)]
            mx.eval([x.state for x in c])
            disk.save([7] * n, c, trimmable=True)
            assert started.wait(10)  # the first is under way; the next two wait
        # 30 covers 20 (dropped before it began); 10 was under way: written, then covered
        gate.set()
        poll_until(disk, lambda _: disk.stats.writes == 2)
        assert disk.stats.dropped_writes == 1 and len(disk) == 1
        assert disk.nearest([7] * 30) is not None
    finally:
        gate.set()
        disk.close()
    assert len(list(tmp_path.glob("afmkv-*"))) == 1


def test_stale_temporary_files_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / "afmkv-abc.safetensors.999999999.tmp"
    live = tmp_path / f"afmkv-def.safetensors.{os.getppid()}.tmp"
    foreign = tmp_path / "notes.safetensors"
    for f in (dead, live, foreign):
        f.write_bytes(b"x")
    DiskPromptCache(tmp_path, 1 << 20, "fp").close()
    assert not dead.exists() and live.exists() and foreign.exists()


def test_pinned_entries_are_evicted_after_the_unpinned_until_their_ttl(tmp_path: Path) -> None:
    disk = DiskPromptCache(tmp_path, 1 << 30, "fp")
    saved(disk, [1] * 50)
    one = disk.stats.bytes
    disk.close()
    for f in tmp_path.iterdir():
        f.unlink()
    now = [100.0]
    disk = DiskPromptCache(tmp_path, int(one * 2.5), "fp")
    disk.clock = lambda: now[0]
    try:
        disk.pin([1] * 40, 300.0)  # a breakpoint inside the first entry
        saved(disk, [1] * 50)
        saved(disk, [2] * 50)
        saved(disk, [3] * 50)  # over the budget: [2]*50 goes although [1]*50 is older
        assert disk.nearest([2] * 50) is None and disk.stats.evictions == 1
        assert disk.nearest([1] * 50) is not None
        saved(disk, [4] * 50)  # and again: [3]*50
        assert disk.nearest([3] * 50) is None and disk.nearest([1] * 50) is not None
        now[0] += 301  # the pin expired: plain LRU, the oldest goes
        saved(disk, [5] * 50)
        assert disk.nearest([1] * 50) is None and disk.nearest([4] * 50) is not None
        assert disk.stats.evictions == 3
    finally:
        disk.close()


def test_a_read_refreshes_the_pins_on_what_it_read(tmp_path: Path) -> None:
    now = [100.0]
    disk = DiskPromptCache(tmp_path, 1 << 30, "fp")
    disk.clock = lambda: now[0]
    try:
        disk.pin([1] * 40, 300.0)
        disk.pin([1] * 40, 60.0)  # a shorter ttl given later changes neither expiry nor ttl
        now[0] = 350.0
        disk.refresh([1] * 30)  # read less than the pinned prefix: no refresh
        disk.refresh([1] * 40, adapter=1)  # another adapter's read: none either
        assert disk.pins() == {(0, (1,) * 40): 400.0}
        disk.refresh([1] * 45)  # read all of it (and more): its ttl from now
        assert disk.pins() == {(0, (1,) * 40): 650.0}
        now[0] = 651.0
        disk.refresh([1] * 45)  # expired: nothing to refresh, it is forgotten
        assert disk.pins() == {} and disk._pins._ttl == {}
    finally:
        disk.close()
