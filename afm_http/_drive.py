"""One driver for every wire API's writer: the streamed body and the collected answer.

A generating route parses its body, opens one engine stream per choice
(:func:`~afm_http._streaming.open_model_choices`), builds its API's writer
(:class:`afm_core.api.writer.Writer`) and returns :func:`respond`; the rest is
here, the same for every API:

* **streamed** (:func:`drive`): the writer's opening bytes, then one write per
  engine step (the batches of every choice that has one, :func:`next_batches`),
  the writer's keepalive whenever ``ServerConfig.keepalive_seconds`` pass
  without a batch (an SSE comment, Anthropic's ``ping``; nothing for NDJSON),
  until the writer is done or every stream ended; then its last bytes.  A
  failure once headers are sent is the writer's in-band error
  (:meth:`Writer.fail`); leaving early (the client disconnected) closes the
  request's stack, which drops every choice at the next engine step;
* **collected** (:func:`collect`): one reader per choice, all at once; a
  choice's failure ends the response (the other readers stop), and
  :meth:`Writer.result` is the answer or raises the API's error;
* both call ``before(choice, batch)`` (when given) before the writer sees a
  batch (Responses counts the reasoning tokens there), and ``cancel()`` once
  :attr:`Writer.stop_requested` (Anthropic's stop sequences end the engine
  request early).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import trio
from quart import Response

from afm_core import ChatStream, RequestError
from afm_core.api.writer import Writer

from ._json import json_response
from ._state import AppState
from ._streaming import STREAM_HEADERS, Batch, Keepalive, aclose_shielded, next_batches

__all__ = ["Before", "check_room", "collect", "drive", "respond"]

log = logging.getLogger("afm.http")

Before = Callable[[int, Batch], Awaitable[None]]
"""Called with each batch of a choice (None: its stream's end) before the writer sees it."""


def check_room(state: AppState, choices: int, *, param: str, what: str = "choices (n)") -> None:
    """A 400 when a request asks for more choices than the server can run at once
    (``max_batch + max_waiting``: each choice is its own engine stream)."""
    room = state.models.config.max_batch + state.models.config.max_waiting
    if choices > room:
        raise RequestError(f"this server runs at most {room} {what} per request", param=param)


async def respond(state: AppState, writer: Writer, streams: Sequence[ChatStream], stack: AsyncExitStack,
                  *, stream: bool, request_id: str, headers: dict[str, str] | None = None,
                  before: Before | None = None,
                  cancel: Callable[[], object] | None = None) -> Response:
    """The HTTP response of a generating route: the streamed body (:func:`drive`),
    or the collected answer; ``stack`` (holding the streams) is closed either way."""
    headers = headers or {}
    if not stream:
        async with stack:
            result = await collect(writer, streams, before=before, cancel=cancel)
        return json_response(result, headers=headers)
    body = drive(writer, streams, stack, request_id=request_id,
                 keepalive=state.config.keepalive_seconds, before=before, cancel=cancel)
    return Response(body, status=200, content_type=writer.media_type,
                    headers={**headers, **STREAM_HEADERS})


async def _step(writer: Writer, got: list[tuple[int, Batch]], live: set[int], before: Before | None,
                cancel: Callable[[], object] | None) -> bytes:
    """The bytes of one engine step (each choice that had a batch, in choice order)."""
    out = []
    for i, batch in sorted(got, key=lambda item: item[0]):
        if before is not None:
            await before(i, batch)
        out.append(writer.close(i) if batch is None else writer.feed(i, batch))
        if batch is None or writer.ended(i):
            live.discard(i)
    if cancel is not None and writer.stop_requested:
        cancel()
    return b"".join(out)


async def drive(writer: Writer, streams: Sequence[ChatStream], stack: AsyncExitStack, *,
                request_id: str, keepalive: float, before: Before | None = None,
                cancel: Callable[[], object] | None = None) -> AsyncIterator[bytes]:
    """The streamed body: one write per engine step (the writer's keepalive after
    ``keepalive`` silent seconds; 0: none), then the writer's end; leaves the
    streams (closes ``stack``) at the end, however it ends."""
    try:
        head = writer.start()
        if head:
            yield head
        live = set(range(len(streams)))
        try:
            while live and not writer.done:
                got = await next_batches(streams, live, keepalive)
                if isinstance(got, Keepalive):
                    data = writer.keepalive()
                else:
                    data = await _step(writer, got, live, before, cancel)
                if data:
                    yield data
        except Exception as exc:  # headers are sent: report in-band
            log.exception("stream %s failed", request_id)
            data = writer.fail(f"stream failed: {exc}")
            if data:
                yield data
        tail = writer.end()
        if tail:
            yield tail
    finally:
        await aclose_shielded(stack)


async def collect(writer: Writer, streams: Sequence[ChatStream], *, before: Before | None = None,
                  cancel: Callable[[], object] | None = None) -> dict[str, Any]:
    """The non-streamed answer: every choice read at once (one reader each), the
    first failure stopping the others; :meth:`Writer.result`."""
    try:
        async with trio.open_nursery() as nursery:

            async def read(i: int) -> None:
                live = {i}
                while live and not writer.done:
                    batch = await streams[i].next_batch()
                    await _step(writer, [(i, batch)], live, before, cancel)
                if writer.done:
                    nursery.cancel_scope.cancel()

            for i in range(len(streams)):
                nursery.start_soon(read, i)
    except Exception as exc:
        writer.fail(f"stream failed: {exc}")  # (a Responses answer is stored as failed)
        raise
    writer.end()
    return writer.result()
