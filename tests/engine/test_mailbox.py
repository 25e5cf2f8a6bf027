"""The per-stream mailbox between the engine's hand-off and the reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from afm_core._engine.engine import open_engine
from afm_core._engine.mailbox import Mailbox
from afm_core._stream.events import ContentDelta, Finish
from afm_core.api.chat_request import ChatRequest


def text(i: int) -> ContentDelta:
    return ContentDelta(str(i))


async def test_a_late_reader_gets_everything_in_one_batch() -> None:
    box = Mailbox()
    for i in range(100):
        box.put((text(i),))
    assert await box.take() == tuple(text(i) for i in range(100))
    box.put((text(100),))
    box.close()
    box.put((text(101),))  # after close: dropped
    assert await box.take() == (text(100),)
    assert await box.take() is None
    assert await box.take() is None


async def test_a_waiting_reader_wakes_on_put_and_close() -> None:
    box = Mailbox()
    got: list[object] = []

    async def reader() -> None:
        while (batch := await box.take()) is not None:
            got.append(batch)
        got.append(None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        box.put((text(1), text(2)))
        await trio.testing.wait_all_tasks_blocked()
        box.put((text(3),))
        box.close()
    assert got == [(text(1), text(2)), (text(3),), None]


async def test_take_is_a_checkpoint_and_cancellable() -> None:
    box = Mailbox()
    with trio.move_on_after(0.01) as scope:
        await box.take()
    assert scope.cancelled_caught
    box.put((text(1),))  # nobody waiting any more: kept for the next take
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await box.take()
    assert await box.take() == (text(1),)


async def test_one_reader_at_a_time() -> None:
    box = Mailbox()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(box.take)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await box.take()
        box.close()


async def test_a_slow_engine_reader_catches_up_in_few_batches(echo_model_dir: Path) -> None:
    said = "one two three four five six seven eight nine ten " * 4
    r = ChatRequest.from_openai({"messages": [{"role": "user", "content": said}]})
    async with open_engine(echo_model_dir) as engine:
        async with engine.stream(r) as s:
            assert not s.finished
            with trio.fail_after(30):
                while not s.finished:
                    await trio.sleep(0.01)  # the whole generation happens before the first read
            assert engine.statistics().finished == {"stop": 1}
            batches = [b async for b in s.batches()]
    assert len(batches) == 1
    events = batches[0]
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == said
    assert Finish("stop") in events
