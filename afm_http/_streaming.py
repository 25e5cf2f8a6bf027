"""What the routes that hold an engine stream share.

A route opens ``engine.stream(...)`` inside an :class:`AsyncExitStack` from
:func:`held_stack`: the request id is held in the app's in-flight registry
(so shutdown can cancel it) and the stack is closed when the ASGI call ends
even if the response body never runs (:func:`close_when_done`).  A body
generator closes it itself, shielded, with :func:`aclose_shielded`, which
leaves the engine stream: an unfinished request is dropped at the next step.
The engine is the request's model's (``state.engine_for``), entered into the
same stack first, so the model stays held (never unloaded) until the stack
closes.  A request with several choices (chat's and completions' ``n``, a
list of prompts) opens them with :func:`open_model_choices`: one stream
each, in one group.

While a streaming request waits (queued behind a full batch, or in a long
prefill) the driver (:mod:`._drive`) reads the engine streams with
:func:`next_batches`, which gives :data:`KEEPALIVE` whenever
``ServerConfig.keepalive_seconds`` pass without an engine batch: the writer
then sends its keepalive.  The reads are cancel-safe
(:meth:`ChatStream.next_batch` takes nothing when cancelled), so a keepalive
never loses an event, and none follows the stream's last batch (the stream
ends without waiting).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import Any, final

import trio

from afm_core import ChatRequest, ChatStream, CompletionRequest, Engine

from ._asgi import close_when_done
from ._registry import ModelChoice
from ._state import AppState

__all__ = ["KEEPALIVE", "STREAM_HEADERS", "Batch", "Keepalive", "aclose_shielded", "held_engine",
           "held_stack", "next_batches", "open_model_choices"]

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

Batch = tuple[Any, ...] | None
"""One :meth:`ChatStream.next_batch` result: the events of an engine step, None at the end."""


@final
class Keepalive:
    """The type of :data:`KEEPALIVE`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "KEEPALIVE"


KEEPALIVE = Keepalive()
"""Nothing arrived for the keepalive interval: write a keepalive (or a ``ping``)."""


def held_stack(state: AppState, request_id: str) -> AsyncExitStack:
    """A stack holding ``request_id`` in flight, closed at the latest when the request ends."""
    stack = AsyncExitStack()
    close_when_done(stack)  # also closed if the body below never runs
    stack.enter_context(state.inflight.hold(request_id))
    return stack


async def aclose_shielded(stack: AsyncExitStack) -> None:
    """Close ``stack`` even inside a cancelled scope (a disconnected client)."""
    with trio.CancelScope(shield=True):
        await stack.aclose()


async def held_engine(state: AppState, choice: ModelChoice | None,
                      request_id: str) -> tuple[AsyncExitStack, Engine]:
    """A :func:`held_stack` holding the chosen model's engine too (loaded if it was not)."""
    stack = held_stack(state, request_id)
    try:
        engine = await stack.enter_async_context(state.engine_for(choice))
    except BaseException:
        await aclose_shielded(stack)
        raise
    return stack, engine


async def open_model_choices(state: AppState, choice: ModelChoice | None,
                             requests: Iterable[ChatRequest | CompletionRequest],
                             request_id: str, *, profile: str | None = None, progress: bool = False,
                             ) -> tuple[AsyncExitStack, Engine, list[ChatStream]]:
    """The chosen model's engine (:func:`held_engine`) and one stream of it per
    choice, in the same stack: choice 0 under the client's ``request_id`` (with the
    ``profile`` and ``progress`` asked for), choice ``i`` as ``<id>/<i>`` in its
    group, so cancelling the id ends them all.  If one cannot open, those already
    open are left (and the model released) and the error raised."""
    stack, engine = await held_engine(state, choice, request_id)
    streams: list[ChatStream] = []
    try:
        for i, req in enumerate(requests):
            first = i == 0
            opened = engine.stream(req, request_id=request_id if first else f"{request_id}/{i}",
                                   group=None if first else request_id,
                                   profile=profile if first else None, progress=progress and first)
            streams.append(await stack.enter_async_context(opened))
    except BaseException:
        await aclose_shielded(stack)
        raise
    return stack, engine, streams


async def next_batches(streams: Sequence[ChatStream], live: Collection[int],
                       keepalive: float = 0) -> list[tuple[int, Batch]] | Keepalive:
    """The next batch of at least one of the ``live`` streams (of every one that
    has one now), or :data:`KEEPALIVE` once ``keepalive`` seconds passed without
    any (0: wait as long as it takes).  One waiter per stream; the first to get a
    batch ends the wait, and a cancelled waiter took nothing (``next_batch`` is
    cancel-safe), so the keepalive deadline, being the waiters' own scope's,
    never loses a batch."""
    if len(live) == 1:
        (i,) = live
        if keepalive <= 0:
            return [(i, await streams[i].next_batch())]
        with trio.move_on_after(keepalive):
            return [(i, await streams[i].next_batch())]
        return KEEPALIVE
    got: list[tuple[int, Batch]] = []
    async with trio.open_nursery() as nursery:

        async def wait(i: int) -> None:
            got.append((i, await streams[i].next_batch()))
            nursery.cancel_scope.cancel()

        for i in sorted(live):
            nursery.start_soon(wait, i)
        if keepalive > 0:
            nursery.cancel_scope.deadline = trio.current_time() + keepalive
    return got or KEEPALIVE
