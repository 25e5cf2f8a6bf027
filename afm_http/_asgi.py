"""The QuartTrio app class, with two guarantees quart-trio does not give.

quart-trio runs each HTTP request as two tasks: one reads ASGI messages, one
runs the handler and sends the response.  When the reader sees
``http.disconnect`` it cancels both.  That cancellation can land

* after the handler returned a streaming response but before quart started
  iterating its body, so the body generator never runs and its ``finally``
  (which leaves ``engine.stream(...)``) never either: the engine would keep
  the request registered and generating.  Handlers therefore register the
  stream's exit stack with :func:`close_when_done`; it is closed when the
  ASGI call ends, whatever happened.
* inside hypercorn's processing of the final ``http.response.body``, which
  itself delivers ``http.disconnect`` when the client has not finished
  sending its body (an early 413): the cancelled send never tells the
  connection to close, leaving it hung.  The final send is shielded (with a
  deadline).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import trio
from quart_trio import QuartTrio

from ._ids import InFlight
from ._state import AppState

if TYPE_CHECKING:
    from hypercorn.typing import ASGISendCallable, ASGISendEvent

__all__ = ["AFMQuart", "close_when_done"]

FINAL_SEND_SECONDS = 10.0

_pending: ContextVar[list[AsyncExitStack] | None] = ContextVar("afm_http_pending", default=None)


def close_when_done(stack: AsyncExitStack) -> None:
    """Close ``stack`` when this request's ASGI call ends (if nothing closed it first)."""
    pending = _pending.get()
    if pending is not None:
        pending.append(stack)


def _shield_final(send: ASGISendCallable) -> ASGISendCallable:
    async def wrapped(message: ASGISendEvent) -> None:
        if message.get("type") == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True), trio.move_on_after(FINAL_SEND_SECONDS):
                await send(message)
        else:
            await send(message)

    return wrapped


class AFMQuart(QuartTrio):
    """QuartTrio with guaranteed per-request cleanup and a shielded final send.

    ``afm_state`` is what the routes share (set by :func:`afm_http.create_app`);
    ``afm_inflight`` holds the request ids open with the engine and
    ``afm_drain()`` cancels them.
    """

    afm_state: AppState

    @property
    def afm_inflight(self) -> InFlight:
        return self.afm_state.inflight

    def afm_drain(self) -> int:
        """Cancel every request this app has open (see :meth:`AppState.drain`)."""
        return self.afm_state.drain()

    async def asgi_app(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await super().asgi_app(scope, receive, send)
            return
        pending: list[AsyncExitStack] = []
        token = _pending.set(pending)
        try:
            await super().asgi_app(scope, receive, _shield_final(send))
        finally:
            _pending.reset(token)
            if pending:
                with trio.CancelScope(shield=True):
                    for stack in pending:
                        await stack.aclose()
