"""What the routes that hold an engine stream share.

A route opens ``engine.stream(...)`` inside an :class:`AsyncExitStack` from
:func:`held_stack`: the request id is held in the app's in-flight registry
(so shutdown can cancel it) and the stack is closed when the ASGI call ends
even if the response body never runs (:func:`close_when_done`).  A body
generator closes it itself, shielded, with :func:`aclose_shielded`, which
leaves the engine stream: an unfinished request is dropped at the next step.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio

from ._asgi import close_when_done
from ._state import AppState

__all__ = ["STREAM_HEADERS", "aclose_shielded", "held_stack"]

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
