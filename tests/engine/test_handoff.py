"""The generation thread's hand-off to Trio (``afm_core._engine.handoff``) and
its body (``afm_core._engine.boot``), on their own: real threads, a real Trio
run, the random tiny model from ``afm_core.testing``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import trio
import trio.testing

from afm_core import EngineConfig
from afm_core._engine.boot import Boot
from afm_core._engine.commands import Delivery, JobKey, Outputs
from afm_core._engine.genthread import run_on_generation_thread
from afm_core._engine.handoff import Handoff
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

