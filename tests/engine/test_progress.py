"""Prompt-progress events (``Engine.stream(..., progress=True)``), on the
random tiny model: one when the prompt starts, one per prefill chunk, the
last at ``processed == total`` before the first token; none without the
opt-in; a prefix-cache hit or a shared prefill starts at the cached tokens."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from afm_core import (
    ChatRequest,
    CompletionRequest,
    ContentDelta,
    Finish,
    LogprobsDelta,
    PromptProgress,
    Usage,
    open_engine,
)
from afm_core._engine.engine import ChatStream
from tests.engine.test_shared_prefill import paused

STEP = 16


def raw(ids: list[int], **kw: Any) -> CompletionRequest:
    return CompletionRequest.from_openai({"temperature": 0, "ignore_eos": True, "logprobs": 0, **kw}, tuple(ids))


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


async def drain(stream: ChatStream) -> list:
    with trio.fail_after(60):
        return [e async for e in stream]


def progress(events: list) -> list[PromptProgress]:
    return [e for e in events if isinstance(e, PromptProgress)]


def first_output(events: list) -> int:
    return next(i for i, e in enumerate(events) if isinstance(e, ContentDelta | LogprobsDelta | Finish))


async def test_progress_counts_each_prefill_chunk_before_the_first_token(random_model_dir: Path) -> None:
    ids = prompt_ids(100, seed=5)
    async with open_engine(random_model_dir, prefill_step=STEP, prefix_cache_bytes=0, warmup=False) as engine:
        async with engine.stream(raw(ids, max_tokens=3), progress=True) as s:
            events = await drain(s)
        async with engine.stream(raw(ids, max_tokens=3)) as s:
            plain = await drain(s)
        assert engine.statistics().ttft_count == 2
    seen = progress(events)
    # admitted (nothing cached), the prompt but its last token in chunks of STEP,
    # then the last token as generation starts
    assert [p.processed for p in seen] == [0, 16, 32, 48, 64, 80, 96, 99, 100]
    assert all(p.total == 100 and p.cached == 0 for p in seen)
    assert [p.time_ms for p in seen] == sorted(p.time_ms for p in seen)
    assert max(events.index(p) for p in seen) < first_output(events)
    assert events[-2] == Finish("length") and events[-1] == Usage(100, 3, 0)
    # without the opt-in: the same stream, no progress
    assert not progress(plain)
    assert [e for e in events if not isinstance(e, PromptProgress)] == plain


async def test_no_progress_without_the_opt_in_chat(random_model_dir: Path) -> None:
    body = {"messages": [{"role": "user", "content": "a chat prompt of a few tokens " * 8}],
            "max_tokens": 4, "temperature": 0}
    async with open_engine(random_model_dir, prefill_step=STEP, warmup=False) as engine:
        async with engine.stream(body) as s:
            plain = await drain(s)
        async with engine.stream(ChatRequest.from_openai(body), progress=True) as s:
            events = await drain(s)
    assert not progress(plain) and plain[-2] == Finish("length")
    seen = progress(events)
    total = events[-1].prompt_tokens
    assert seen and seen[-1].processed == seen[-1].total == total
    assert [p.processed for p in seen] == sorted({p.processed for p in seen})  # strictly increasing
    assert max(events.index(p) for p in seen) < first_output(events)


async def test_a_prefix_cache_hit_starts_at_the_cached_tokens(random_model_dir: Path) -> None:
    ids = prompt_ids(80, seed=6)
    async with open_engine(random_model_dir, prefill_step=STEP, warmup=False) as engine:
        async with engine.stream(raw(ids, max_tokens=2)) as s:
            await drain(s)  # its cache is kept when it ends
        longer = [*ids, *prompt_ids(40, seed=7)]
        async with engine.stream(raw(longer, max_tokens=2), progress=True) as s:
            events = await drain(s)
    cached = events[-1].cached_tokens
    assert cached >= len(ids) - 1 > 0
    seen = progress(events)
    assert seen[0] == PromptProgress(cached, len(longer), cached, seen[0].time_ms)
    assert [p.processed for p in seen[1:]] == [*range(cached + STEP, len(longer) - 1, STEP), len(longer) - 1,
                                                len(longer)]
    assert all(p.cached == cached and p.total == len(longer) for p in seen)


async def test_a_parked_stream_gets_progress_when_it_starts(random_model_dir: Path) -> None:
    ids = prompt_ids(70, seed=8)
    async with open_engine(random_model_dir, prefill_step=STEP, prefix_cache_bytes=0, warmup=False) as engine:
        results: list[list] = [[], []]
        async with AsyncExitStack() as stack:
            async with paused(engine):
                streams = [await stack.enter_async_context(engine.stream(raw(ids, max_tokens=2), progress=True))
                           for _ in range(2)]
            async with trio.open_nursery() as nursery:
                for i, s in enumerate(streams):
                    async def one(i: int = i, s: ChatStream = s) -> None:
                        results[i] = await drain(s)
                    nursery.start_soon(one)
    leader, parked = (progress(events) for events in results)
    assert [p.processed for p in leader] == [0, 16, 32, 48, 64, 69, 70]
    # it waited for the leader's prefill, then started from its copy: one token left
    assert [(p.processed, p.total, p.cached) for p in parked] == [(69, 70, 69), (70, 70, 69)]
    assert max(results[1].index(p) for p in parked) < first_output(results[1])
    assert results[1][-1].cached_tokens == 69
