"""A request that leaves before it ends keeps what it computed: its prefill so
far (or its prompt and output) goes to the prefix cache, in memory and, with
``cache_dir``, on disk, so the same prompt sent again (a client's retry)
resumes there (its ``cached_tokens``) instead of starting over."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import trio

from afm_core import CompletionRequest, Finish, Usage, open_engine
from afm_core._engine.engine import Engine

STEP = 16


def raw(ids: list[int], **kw: Any) -> CompletionRequest:
    return CompletionRequest.from_openai({"temperature": 0, "ignore_eos": True, **kw}, tuple(ids))


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


class Hold:
    """Hold the generation thread once it has run ``steps`` engine steps from
    now (each prefills one chunk of ``STEP`` tokens of a lone prompt), until
    :meth:`release`; commands sent meanwhile apply before its next step."""

    def __init__(self, engine: Engine, steps: int) -> None:
        worker = engine._worker
        assert worker is not None
        self.worker, self.real = worker, worker._step
        self.gate, self.holding = threading.Event(), threading.Event()
        count = 0

        def step(outputs: Any) -> None:
            nonlocal count
            self.real(outputs)
            count += 1
            if count == steps:
                self.holding.set()
                self.gate.wait(30)

        worker._step = step  # type: ignore[method-assign]

    async def reached(self) -> None:
        await trio.to_thread.run_sync(lambda: self.holding.wait(30))
        assert self.holding.is_set(), "the generation thread never got there"

    def release(self) -> None:
        self.worker._step = self.real  # type: ignore[method-assign]
        self.gate.set()


async def usage_of(engine: Engine, ids: list[int]) -> Usage:
    async with engine.stream(raw(ids, max_tokens=2)) as s:
        with trio.fail_after(60):
            events = [e async for e in s]
    assert isinstance(events[-1], Usage)
    return events[-1]


async def test_a_cancelled_prefill_keeps_its_prefix(random_model_dir: Path) -> None:
    ids = prompt_ids(400, seed=1)
    async with open_engine(random_model_dir, prefill_step=STEP, warmup=False) as engine:
        hold = Hold(engine, 3)
        async with engine.stream(raw(ids, max_tokens=4), request_id="long") as s:
            await hold.reached()
            assert engine.cancel("long")  # (applied before the thread's next step)
            hold.release()
            with trio.fail_after(60):
                rest = [e async for e in s]
        assert Finish("cancelled") in rest
        assert engine.statistics().kept_prefixes == 1
        retry = await usage_of(engine, ids)
    assert retry.cached_tokens == 3 * STEP  # the three chunks computed, not started over


async def test_a_dropped_stream_keeps_its_prefix(random_model_dir: Path) -> None:
    ids = prompt_ids(400, seed=2)
    async with open_engine(random_model_dir, prefill_step=STEP, warmup=False) as engine:
        hold = Hold(engine, 2)
        async with engine.stream(raw(ids, max_tokens=4)):
            await hold.reached()
        # the client left before its first token: the job is dropped
        hold.release()
        with trio.fail_after(60):
            while engine.statistics().kept_prefixes < 1:
                await trio.sleep(0.01)
        retry = await usage_of(engine, ids)
    assert retry.cached_tokens == 2 * STEP


async def test_a_request_cancelled_while_decoding_keeps_prompt_and_output(random_model_dir: Path) -> None:
    ids = prompt_ids(60, seed=3)
    async with open_engine(random_model_dir, prefill_step=STEP, warmup=False) as engine:
        async with engine.stream(raw(ids, max_tokens=1000), request_id="talk") as s:
            got = 0
            with trio.fail_after(60):
                async for _event in s:
                    got += 1
                    if got >= 5:
                        break
            engine.cancel("talk")
        retry = await usage_of(engine, ids)
    assert retry.cached_tokens == len(ids) - 1  # the whole prompt but the token recomputed


async def test_disk_tier_keeps_it_when_memory_does_not(random_model_dir: Path, tmp_path: Path) -> None:
    ids = prompt_ids(300, seed=4)
    async with open_engine(random_model_dir, prefill_step=STEP, warmup=False, prefix_cache_bytes=0,
                           cache_dir=tmp_path / "kv") as engine:
        hold = Hold(engine, 3)
        async with engine.stream(raw(ids, max_tokens=4), request_id="long"):
            await hold.reached()
            engine.cancel("long")
            hold.release()
        with trio.fail_after(60):
            while engine.statistics().prefix_cache_disk_writes < 1:
                await trio.sleep(0.01)
        retry = await usage_of(engine, ids)
        assert engine.statistics().prefix_cache_disk_hits == 1
    assert retry.cached_tokens == 3 * STEP


async def test_nothing_kept_without_a_prefix_cache(random_model_dir: Path) -> None:
    ids = prompt_ids(300, seed=5)
    async with open_engine(random_model_dir, prefill_step=STEP, warmup=False, prefix_cache_bytes=0) as engine:
        hold = Hold(engine, 2)
        async with engine.stream(raw(ids, max_tokens=4), request_id="long"):
            await hold.reached()
            engine.cancel("long")
            hold.release()
        retry = await usage_of(engine, ids)
        assert engine.statistics().kept_prefixes == 0
    assert retry.cached_tokens == 0
