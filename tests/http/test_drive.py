"""The one driver of every writer (``afm_http._drive``), on scripted streams.

The streams are stand-ins for ``ChatStream`` (``next_batch``: a batch of
events, None at the end; cancel-safe), so each path of the driver runs
deterministically: keepalives while the engine is silent (Trio's virtual
clock: no real waiting, no timing asserted), an exception after headers,
a writer that asks for the engine request to end, the first failure of a
collected answer stopping the other choices, the room check.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from afm_core import ContentDelta, Finish, GenerationError, RequestError, StreamFailure, Usage
from afm_core.api import anthropic, chat
from afm_core.api.writer import SSE_KEEPALIVE
from afm_http._drive import check_room, collect, drive


class Script:
    """A stream that answers with its batches (an exception is raised in its turn),
    the first ``delay`` seconds after it is first read; then None, or nothing ever (``hang``)."""

    def __init__(self, *batches: Any, delay: float = 0, hang: bool = False) -> None:
        self.batches = list(batches)
        self.delay = delay
        self.hang = hang
        self.ready: float | None = None

    async def next_batch(self) -> tuple[Any, ...] | None:
        if self.ready is None:
            self.ready = trio.current_time() + self.delay
        await trio.sleep_until(self.ready)  # a cancelled read takes nothing
        if not self.batches:
            if self.hang:
                await trio.sleep_forever()
            return None
        item = self.batches.pop(0)
        if isinstance(item, BaseException):
            raise item
        return tuple(item)


def closing_stack() -> tuple[AsyncExitStack, list[str]]:
    stack = AsyncExitStack()
    closed: list[str] = []
    stack.callback(closed.append, "closed")
    return stack, closed


def writer(n: int = 1, **kw: Any) -> chat.Writer:
    return chat.Writer(id="c", created=1, model="m", choices=n, include_usage=True, **kw)


async def body(gen: Any) -> list[bytes]:
    return [chunk async for chunk in gen]


async def test_keepalives_while_the_engine_is_silent(autojump_clock: trio.testing.MockClock) -> None:
    stream = Script([ContentDelta("late")], [Finish("stop"), Usage(1, 1)], delay=25)
    stack, closed = closing_stack()
    out = await body(drive(writer(), [stream], stack, request_id="r", keepalive=10))  # type: ignore[list-item]
    assert out[:2] == [SSE_KEEPALIVE, SSE_KEEPALIVE]  # 25 s silent: two keepalives, then the delta
    assert b"late" in out[2] and out[-1] == b"data: [DONE]\n\n" and closed == ["closed"]
    assert SSE_KEEPALIVE not in out[3:]  # none after the last batch


async def test_an_exception_after_headers_is_reported_in_band() -> None:
    stream = Script([ContentDelta("a")], RuntimeError("the disk caught fire"))
    stack, closed = closing_stack()
    out = b"".join(await body(drive(writer(), [stream], stack, request_id="r", keepalive=0)))  # type: ignore[list-item]
    assert b'"content":"a"' in out and b"stream failed: the disk caught fire" in out
    assert out.endswith(b"data: [DONE]\n\n") and closed == ["closed"]


async def test_the_stack_closes_when_the_client_leaves() -> None:
    stream = Script([ContentDelta("a")], hang=True)
    stack, closed = closing_stack()
    gen = drive(writer(), [stream], stack, request_id="r", keepalive=0)  # type: ignore[list-item]
    assert b"a" in await gen.__anext__()
    with trio.move_on_after(0.01):
        await gen.__anext__()  # waits for the engine: the client disconnects meanwhile
    await gen.aclose()
    assert closed == ["closed"]


async def test_a_stop_the_writer_saw_cancels_the_engine_request() -> None:
    cancels: list[int] = []
    stream = Script([ContentDelta("one STOP two")], [ContentDelta(" more")],
                    [Finish("cancelled"), Usage(1, 3)])
    w = anthropic.Writer(anthropic.MessageStream(model="m", stop_sequences=["STOP"]))
    stack, _ = closing_stack()
    out = b"".join(await body(drive(w, [stream], stack, request_id="r", keepalive=0,  # type: ignore[list-item]
                                    cancel=lambda: cancels.append(1))))
    assert cancels and b'"stop_reason":"stop_sequence"' in out and b"more" not in out
    cancels.clear()
    folded = anthropic.Writer(anthropic.MessageStream(model="m", stop_sequences=["STOP"]), stream=False)
    stream = Script([ContentDelta("one STOP two")], [Finish("cancelled"), Usage(1, 3)])
    result = await collect(folded, [stream], cancel=lambda: cancels.append(1))  # type: ignore[list-item]
    assert cancels and result["stop_sequence"] == "STOP"


async def test_collect_reads_every_choice_and_the_first_failure_stops_the_rest() -> None:
    ok = [Script([ContentDelta(t)], [Finish("stop"), Usage(2, 1)]) for t in "ab"]
    result = await collect(writer(2, stream=False), ok)  # type: ignore[arg-type]
    assert [c["message"]["content"] for c in result["choices"]] == ["a", "b"]
    endless = Script([ContentDelta("x")], hang=True)
    failing = Script([StreamFailure("boom")], delay=0.01)
    with pytest.raises(GenerationError, match="boom"):
        with trio.fail_after(5):  # the endless choice is stopped, not waited for
            await collect(writer(2, stream=False), [endless, failing])  # type: ignore[list-item]


async def test_collect_calls_before_with_each_batch_and_the_end() -> None:
    seen: list[Any] = []

    async def before(choice: int, batch: Any) -> None:
        seen.append((choice, batch if batch is None else len(batch)))

    stream = Script([ContentDelta("a")])  # ends without a finish
    w = writer(stream=False)
    with pytest.raises(GenerationError, match="ended before it finished"):
        await collect(w, [stream], before=before)  # type: ignore[list-item]
    assert seen == [(0, 1), (0, None)]


def test_check_room() -> None:
    state = SimpleNamespace(models=SimpleNamespace(config=SimpleNamespace(max_batch=2, max_waiting=1)))
    check_room(state, 3, param="n")  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="at most 3 choices \\(n\\) per request") as err:
        check_room(state, 4, param="n")  # type: ignore[arg-type]
    assert err.value.param == "n"
