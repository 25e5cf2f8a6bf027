"""Streams with the same prompt share one prefill (the generation thread's
shared prefill, ``afm_core._engine.worker``), on the random tiny model: the
later ones park on the first one's prefill and start from a copy of its
cache; their output is the one a stream alone gives; a leader leaving before
its prefill ends hands its parked streams back to admission."""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.models.cache import KVCache

from afm_core import (
    CompletionRequest,
    ContentDelta,
    Finish,
    LogprobsDelta,
    PromptProgress,
    Usage,
    open_engine,
)
from afm_core._engine.engine import ChatStream, Engine
from tests.engine.test_engine import settled


def raw(ids: list[int], **kw: Any) -> CompletionRequest:
    return CompletionRequest.from_openai({"temperature": 0, "ignore_eos": True, "logprobs": 0, **kw}, tuple(ids))


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def tokens(events: list) -> list[str]:
    """The generated tokens, one per LogprobsDelta entry (``logprobs=0``)."""
    return [t.token for e in events if isinstance(e, LogprobsDelta) for t in e.content]


def text(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


async def drain(stream: ChatStream) -> list:
    with trio.fail_after(60):  # a stream left parked fails here instead of hanging
        return [e async for e in stream]


@asynccontextmanager
async def paused(engine: Engine) -> AsyncIterator[None]:
    """Hold the generation thread between two steps (a ``Sync`` callback that
    waits): commands sent meanwhile are all applied in its next iteration."""
    worker = engine._worker
    assert worker is not None
    gate, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        gate.wait(30)

    worker.sync(hold)
    with trio.fail_after(10):
        await trio.to_thread.run_sync(holding.wait)
    try:
        yield
    finally:
        gate.set()


def test_a_deep_copied_cache_row_is_independent() -> None:
    """What a parked stream starts from: writes to either cache leave the other alone."""
    row = [KVCache(), KVCache()]
    for c in row:
        c.update_and_fetch(mx.random.normal((1, 2, 5, 4)), mx.random.normal((1, 2, 5, 4)))
    mx.eval([c.state for c in row])
    twin = copy.deepcopy(row)
    kept = [(mx.array(c.keys), mx.array(c.values)) for c in twin]
    for c in row:
        c.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
        c.keys[..., 0, :] = 7.0
    mx.eval([c.state for c in row])
    for c, (k, v) in zip(twin, kept, strict=True):
        assert c.offset == 5 and mx.array_equal(c.keys, k).item() and mx.array_equal(c.values, v).item()
    twin[0].update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
    assert row[0].offset == 8 and twin[0].offset == 6


@pytest.mark.parametrize("prefix_cache_bytes", [0, 1 << 30])
async def test_identical_prompts_prefill_once_and_match_one_stream(random_model_dir: Path,
                                                                   prefix_cache_bytes: int) -> None:
    ids = prompt_ids(60, seed=1)
    request = raw(ids, max_tokens=16)
    n = 4
    async with open_engine(random_model_dir, prefix_cache_bytes=prefix_cache_bytes, warmup=False) as engine:
        async with engine.stream(request) as s:
            alone = await drain(s)
        before = await settled(engine)
        computed0 = engine._worker.stats.computed_prompt_tokens
        results: list[list] = [[] for _ in range(n)]
        async with AsyncExitStack() as stack:
            async with paused(engine):  # admitted together: the first prefills, the others park
                streams = [await stack.enter_async_context(engine.stream(request, request_id=f"r{i}"))
                           for i in range(n)]
            async with trio.open_nursery() as nursery:
                for i, s in enumerate(streams):
                    async def one(i: int = i, s: ChatStream = s) -> None:
                        results[i] = await drain(s)
                    nursery.start_soon(one)
        after = await settled(engine)
        computed = engine._worker.stats.computed_prompt_tokens - computed0
    assert tokens(alone) and len(tokens(alone)) == 16
    for events in results:
        assert tokens(events) == tokens(alone)
        assert text(events) == text(alone)
        assert events[-2] == Finish("length")
    usages = [events[-1] for events in results]
    assert all(isinstance(u, Usage) and u.prompt_tokens == len(ids) for u in usages)
    # the prompt was computed once: each follower computed its last token only
    assert after.shared_prefills - before.shared_prefills == n - 1
    if prefix_cache_bytes:  # the leader itself hit the cache of the run alone
        assert computed == 1 + (n - 1)
        assert sorted(u.cached_tokens for u in usages) == [len(ids) - 1] * n
    else:
        assert computed == len(ids) + (n - 1)
        assert sorted(u.cached_tokens for u in usages) == [0] + [len(ids) - 1] * (n - 1)
    assert after.prompt_tokens - before.prompt_tokens == n * len(ids)


async def _wait_mid_prefill(stream: ChatStream, seen: list, mid: trio.Event) -> None:
    """Read ``stream`` (opened with ``progress=True``), setting ``mid`` at the
    first progress event inside the prompt."""
    with trio.fail_after(60):
        async for e in stream:
            seen.append(e)
            if isinstance(e, PromptProgress) and 0 < e.processed < e.total:
                mid.set()


@pytest.mark.parametrize("how", ["cancel", "drop"])
async def test_the_leader_leaving_mid_prefill_hands_over_to_a_follower(random_model_dir: Path, how: str) -> None:
    ids = prompt_ids(400, seed=2)
    request = raw(ids, max_tokens=8)
    n = 3
    # 4-token prefill chunks: about 100 steps of prefill
    async with open_engine(random_model_dir, prefix_cache_bytes=0, prefill_step=4, warmup=False) as engine:
        worker = engine._worker
        assert worker is not None
        async with engine.stream(request) as s:
            alone = await drain(s)
        before = await settled(engine)
        computed0 = worker.stats.computed_prompt_tokens
        leader_events: list = []
        results: list[list] = [[] for _ in range(n - 1)]
        mid = trio.Event()
        left = trio.Event()
        async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
            leader_scope = trio.CancelScope()

            async def lead(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                with leader_scope:
                    async with engine.stream(request, request_id="leader", progress=True) as s:
                        task_status.started()
                        await _wait_mid_prefill(s, leader_events, mid)
                left.set()

            async with paused(engine):
                await nursery.start(lead)
                followers = [await stack.enter_async_context(engine.stream(request, request_id=f"f{i}"))
                             for i in range(n - 1)]
            with trio.fail_after(30):
                await mid.wait()
            async with paused(engine):
                key = engine._inflight["leader"].key
                assert key in worker.leading  # still prefilling, the others parked on it
                assert len(worker.by_key[key].followers) == n - 1
                if how == "cancel":
                    assert engine.cancel("leader")
                else:
                    leader_scope.cancel()  # leaving the stream: a Drop
                    await left.wait()
            for i, s in enumerate(followers):
                async def one(i: int = i, s: ChatStream = s) -> None:
                    results[i] = await drain(s)
                nursery.start_soon(one)
        after = await settled(engine)
        computed = worker.stats.computed_prompt_tokens - computed0
        assert not worker.by_key and not worker.leaders and not worker.orphans and not worker.early
    if how == "cancel":
        assert leader_events[-2] == Finish("cancelled")
        assert leader_events[-1] == Usage(len(ids), 0, 0)
    else:
        assert not any(isinstance(e, Finish) for e in leader_events)
    for events in results:
        assert tokens(events) == tokens(alone) and len(tokens(alone)) == 8
        assert events[-2] == Finish("length")
    # the leader's insertion counted the whole prompt, the promoted follower
    # prefilled it again, the last one shared the promoted one's prefill
    assert computed == 2 * len(ids) + 1
    assert after.shared_prefills - before.shared_prefills == 1
    assert sorted(e[-1].cached_tokens for e in results) == [0, len(ids) - 1]


async def test_cancelling_a_parked_follower(random_model_dir: Path) -> None:
    ids = prompt_ids(400, seed=3)
    request = raw(ids, max_tokens=6)
    async with open_engine(random_model_dir, prefix_cache_bytes=0, prefill_step=4, warmup=False) as engine:
        worker = engine._worker
        assert worker is not None
        async with engine.stream(request) as s:
            alone = await drain(s)
        before = await settled(engine)
        computed0 = worker.stats.computed_prompt_tokens
        leader_events: list = []
        mid = trio.Event()
        got: dict[str, list] = {}
        async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
            async with paused(engine):
                leader = await stack.enter_async_context(engine.stream(request, request_id="leader",
                                                                       progress=True))
                parked = [await stack.enter_async_context(engine.stream(request, request_id=f"f{i}"))
                          for i in range(2)]
            nursery.start_soon(_wait_mid_prefill, leader, leader_events, mid)
            with trio.fail_after(30):
                await mid.wait()
            async with paused(engine):
                key = engine._inflight["f0"].key
                assert worker.by_key[key].leader is not None and worker.by_key[key].uid is None
                assert worker.stats.parked == 2
                assert engine.cancel("f0")
            for name, s in zip(("f0", "f1"), parked, strict=True):
                async def one(name: str = name, s: ChatStream = s) -> None:
                    got[name] = await drain(s)
                nursery.start_soon(one)
        after = await settled(engine)
        computed = worker.stats.computed_prompt_tokens - computed0
    assert got["f0"] == [Finish("cancelled"), Usage(len(ids), 0, 0)]
    assert tokens(got["f1"]) == tokens(alone) == tokens(leader_events)
    assert got["f1"][-1].cached_tokens == len(ids) - 1
    assert computed == len(ids) + 1
    assert after.shared_prefills - before.shared_prefills == 1
    assert after.finished.get("cancelled", 0) - before.finished.get("cancelled", 0) == 1


async def test_a_different_or_scored_prompt_is_not_parked(random_model_dir: Path) -> None:
    ids = prompt_ids(60, seed=4)
    other = [*ids[:-1], (ids[-1] + 1) % 1000 or 3]  # the same but for the last token
    requests = [raw(ids, max_tokens=4), raw(other, max_tokens=4), raw(ids[:40], max_tokens=4),
                raw(ids, max_tokens=4, echo=True)]  # scores its prompt: its own prefill
    # a scored prompt asks for prompt_logprobs: echo + logprobs
    assert requests[3].prompt_logprobs is not None
    async with open_engine(random_model_dir, prefix_cache_bytes=0, warmup=False) as engine:
        worker = engine._worker
        assert worker is not None
        before = await settled(engine)
        computed0 = worker.stats.computed_prompt_tokens
        results: list[list] = [[] for _ in requests]
        async with AsyncExitStack() as stack:
            async with paused(engine):
                streams = [await stack.enter_async_context(engine.stream(r)) for r in requests]
            async with trio.open_nursery() as nursery:
                for i, s in enumerate(streams):
                    async def one(i: int = i, s: ChatStream = s) -> None:
                        results[i] = await drain(s)
                    nursery.start_soon(one)
        after = await settled(engine)
        computed = worker.stats.computed_prompt_tokens - computed0
    assert after.shared_prefills == before.shared_prefills
    assert computed == 3 * len(ids) + 40
    assert all(events[-2] == Finish("length") and events[-1].cached_tokens == 0 for events in results)
