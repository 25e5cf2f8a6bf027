"""The generation thread's hand-offs to Trio (``afm_core._engine.handoff``) and
its body (``afm_core._engine.boot``), on their own: real threads, a real Trio
run, the random tiny model from ``afm_core.testing``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from afm_core import EngineClosedError, EngineConfig
from afm_core._engine.boot import Boot
from afm_core._engine.commands import Delivery, JobKey, Outputs
from afm_core._engine.genthread import run_on_generation_thread
from afm_core._engine.handoff import Handoff, embedding_answer
from afm_core._engine.startup import Started, StartFailed


def step(n: int) -> Outputs:
    return {JobKey(n): Delivery((), False)}


async def test_posts_from_a_thread_arrive_in_order() -> None:
    got: list[Outputs] = []
    all_in = trio.Event()

    def dispatch(outputs: Outputs) -> None:
        assert threading.current_thread() is threading.main_thread()  # Trio's thread
        got.append(outputs)
        if len(got) == 200:
            all_in.set()

    handoff = Handoff(trio.lowlevel.current_trio_token(), dispatch)

    def thread() -> None:
        for n in range(200):
            handoff.post(step(n))

    await trio.to_thread.run_sync(thread)
    with trio.fail_after(10):
        await all_in.wait()
    assert got == [step(n) for n in range(200)]


async def test_one_drain_takes_everything_posted_since_the_last() -> None:
    drains: list[int] = []
    got: list[Outputs] = []
    handoff = Handoff(trio.lowlevel.current_trio_token(), got.append)
    real = handoff._drain

    def counting() -> None:
        drains.append(len(handoff._pending))
        real()

    handoff._drain = counting  # type: ignore[method-assign]
    for n in range(3):  # no checkpoint in between: one callback is scheduled
        handoff.post(step(n))
    await trio.testing.wait_all_tasks_blocked()
    assert drains == [3] and got == [step(0), step(1), step(2)]
    handoff.post(step(3))  # the next post schedules again
    await trio.testing.wait_all_tasks_blocked()
    assert drains == [3, 1] and got[-1] == step(3)


def test_a_post_after_the_run_ended_is_dropped() -> None:
    got: list[Outputs] = []

    async def main() -> Handoff:
        return Handoff(trio.lowlevel.current_trio_token(), got.append)

    handoff = trio.run(main)
    handoff.post(step(1))  # no error: nobody is left to read it
    assert got == []


async def _boot(path: Path, config: EngineConfig) -> tuple[Boot, Any, list[Outputs]]:
    posted: list[Outputs] = []
    boot = Boot(path, config, post=posted.append, token=trio.lowlevel.current_trio_token())
    thread = run_on_generation_thread(boot.run)
    with trio.fail_after(120):
        await boot.ready.wait()
    return boot, thread, posted


async def test_boot_starts_a_worker_and_stops_with_it(random_model_dir: Path) -> None:
    boot, thread, _ = await _boot(random_model_dir, EngineConfig(warmup=False))
    started = boot.startup
    assert isinstance(started, Started)
    assert started.worker.config.max_batch == EngineConfig().max_batch
    assert started.worker.model_key == str(random_model_dir)
    assert started.info.path == random_model_dir and started.tables is not None
    assert started.worker.fatal is None
    started.worker.stop()
    with trio.fail_after(60):
        await trio.to_thread.run_sync(thread.join)
    assert started.worker.fatal is None


async def test_boot_reports_what_stopped_it(tmp_path: Path, random_model_dir: Path) -> None:
    boot, thread, _ = await _boot(tmp_path, EngineConfig(warmup=False))  # no model there
    assert isinstance(boot.startup, StartFailed)
    await trio.to_thread.run_sync(thread.join)
    config = EngineConfig(warmup=False, draft_model=tmp_path / "missing", spec_max_batch=1)
    boot, thread, _ = await _boot(random_model_dir, config)
    assert isinstance(boot.startup, StartFailed)
    await trio.to_thread.run_sync(thread.join)



class _Thread:
    """A stand-in generation thread for ``embedding_answer``: answers each
    Embed command from another thread, or never."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.cmds: list[Any] = []

    def embed(self, cmd: Any) -> None:
        self.cmds.append(cmd)
        if self.answer:
            threading.Thread(target=cmd.done, args=([[1.0, 0.0]],)).start()


async def test_an_embedding_s_answer_comes_back_from_the_thread() -> None:
    waits: set[trio.Event] = set()
    thread = _Thread(answer=True)
    with trio.fail_after(10):
        got = await embedding_answer(thread, [(1, 2)], "mean", waits)  # type: ignore[arg-type]
    assert got == [[1.0, 0.0]] and not waits
    [cmd] = thread.cmds
    assert cmd.token_lists == ((1, 2),) and cmd.pooling == "mean" and cmd.abandoned.is_set()


async def test_a_caller_that_leaves_abandons_its_embedding_and_a_stop_ends_the_wait() -> None:
    waits: set[trio.Event] = set()
    thread = _Thread(answer=False)
    with trio.move_on_after(0.05):
        await embedding_answer(thread, [(1,)], "last", waits)  # type: ignore[arg-type]
    assert thread.cmds[0].abandoned.is_set() and not waits  # the thread skips it

    async def stop_soon() -> None:
        await trio.testing.wait_all_tasks_blocked()
        for event in list(waits):
            event.set()  # what Engine.run does when it stops

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_soon)
        with pytest.raises(EngineClosedError):
            await embedding_answer(thread, [(1,)], "last", waits)  # type: ignore[arg-type]
