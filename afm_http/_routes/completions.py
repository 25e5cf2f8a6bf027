"""``POST /v1/completions``: OpenAI's legacy Completions, streamed or not.

The body is validated by :func:`afm_core.api.completions.parse` into one
engine request per choice (a list of prompts, or ``n`` > 1, gives several);
each runs as its own engine stream, all at once, under the client's request
id (the first stream's id, the others ``<id>/<i>`` in its group), so the
chat cancel route, ``POST /v1/chat/completions/{id}/cancel``, ends every
choice with ``finish_reason: "cancelled"``.  ``X-AFM-Profile`` profiles choice
0 as chat's does: its ``afm_profile`` (or ``afm_profile_extended``) object
comes after the usage, before ``[DONE]``, and is a top-level field of the
non-streaming answer.  The translation's writer turns
the streams' events into ``text_completion`` chunks: one write per engine
step (the SSE comment ``: keepalive`` while the engine is silent,
``ServerConfig.keepalive_seconds``), then ``data: [DONE]``; the non-streaming
answer folds the same chunks.

Before headers are sent every failure is an HTTP status with the OpenAI
error envelope; after a stream began, a failure is an error chunk followed
by ``data: [DONE]`` (and the other choices stop).  Leaving early (client
disconnect) drops every stream at the next engine step.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from typing import Any

import trio
from quart import Response

from afm_core import (
    ChatStream,
    Engine,
    GenerationError,
    RequestError,
    StreamErrorChunk,
    StreamFailure,
)
from afm_core.api import completions as api

from .._asgi import AFMQuart
from .._json import json_response
from .._request import model_choice, profile_requested, progress_requested, read_json, request_id
from .._state import current_state
from .._streaming import (
    KEEPALIVE_FRAME,
    STREAM_HEADERS,
    Batch,
    Keepalive,
    aclose_shielded,
    next_batches,
    open_model_choices,
)

__all__ = ["register"]

log = logging.getLogger("afm.http")


def register(app: AFMQuart) -> None:
    app.post("/v1/completions")(text_completions)


async def text_completions() -> Response:
    state = current_state()
    body = await read_json()
    call = api.parse(body)
    room = state.models.config.max_batch + state.models.config.max_waiting
    if call.choices > room:
        raise RequestError(f"this server runs at most {room} choices (prompts times n) per request",
                           param="prompt")
    profile = profile_requested()
    progress = call.stream and progress_requested(call.include_progress)
    rid = request_id()
    stack, engine, streams = await open_model_choices(state, model_choice(body), call.requests, rid,
                                                      profile=profile, progress=progress)
    try:
        echo = await _echo_texts(engine, call) if call.echo else ()
    except BaseException:
        await aclose_shielded(stack)
        raise
    first = streams[0]
    writer = api.CompletionWriter(call, id=first.id, created=first.created, model=first.model,
                                  echo=echo)
    if not call.stream:
        async with stack:
            chunks = await _gather(streams, writer)
        try:
            return json_response(api.collect(chunks))
        except StreamErrorChunk as exc:
            raise _as_error(exc) from None
    body = _sse_body(streams, writer, stack, request_id=rid,
                     keepalive=state.config.keepalive_seconds)
    return Response(body, status=200, content_type="text/event-stream", headers=STREAM_HEADERS)


async def _echo_texts(engine: Engine, call: api.Completion) -> list[str]:
    """Each choice's prompt as text (token ids decoded)."""
    texts: dict[object, str] = {}
    out = []
    for req in call.requests:
        p = req.prompt
        if p not in texts:
            texts[p] = p if isinstance(p, str) else await engine.detokenize(list(p))
        out.append(texts[p])
    return out


def _as_error(exc: StreamErrorChunk) -> Exception:
    """A failed choice of a non-streaming response, as the error to answer with."""
    if exc.type == "invalid_request_error":
        return RequestError(exc.message, param=exc.param, code=exc.code)
    return GenerationError(exc.message, code=exc.code)


INTERRUPTED = StreamFailure("the stream ended before it finished", code="stream_interrupted")
"""A choice whose stream the engine closed without a finish (shutdown)."""


def _feed(writer: api.CompletionWriter, stream: ChatStream, i: int, batch: Batch) -> list[dict[str, Any]]:
    """Choice ``i``'s chunks for one batch of its stream (None: the stream's end)."""
    if batch is None:
        return [] if writer.ended(i) else writer.feed(i, [INTERRUPTED])
    return writer.feed(i, batch, stream.prompt_logprobs)


async def _gather(streams: Sequence[ChatStream], writer: api.CompletionWriter) -> list[dict[str, Any]]:
    """Every chunk of every choice (the non-streaming answer): one reader per
    stream; the first failure stops the others."""
    chunks: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:

        async def read(i: int) -> None:
            stream = streams[i]
            while not writer.ended(i):
                batch = await stream.next_batch()
                chunks.extend(_feed(writer, stream, i, batch))
                if writer.error is not None:
                    nursery.cancel_scope.cancel()
                if batch is None:
                    return

        for i in range(len(streams)):
            nursery.start_soon(read, i)
    return chunks


async def _steps(streams: Sequence[ChatStream], writer: api.CompletionWriter,
                 keepalive: float) -> AsyncIterator[list[dict[str, Any]] | Keepalive]:
    """The chunks of each engine step, every choice's, until all ended or one
    failed (the streaming answer: one write each), or KEEPALIVE after
    ``keepalive`` seconds without any."""
    live = set(range(len(streams)))
    while live and writer.error is None:
        got = await next_batches(streams, live, keepalive)
        if isinstance(got, Keepalive):
            yield got
            continue
        out: list[dict[str, Any]] = []
        for i, batch in got:
            out += _feed(writer, streams[i], i, batch)
            if batch is None or writer.ended(i):
                live.discard(i)
        if out:
            yield out


async def _sse_body(streams: Sequence[ChatStream], writer: api.CompletionWriter, stack: AsyncExitStack,
                    *, request_id: str, keepalive: float) -> AsyncIterator[bytes]:
    """The SSE body: one write per engine step (a keepalive comment after
    ``keepalive`` silent seconds), then ``[DONE]``; leaves the streams at the end."""
    try:
        try:
            async for chunks in _steps(streams, writer, keepalive):
                yield KEEPALIVE_FRAME if isinstance(chunks, Keepalive) else api.encode(chunks)
        except Exception as exc:  # headers are sent: report in-band
            log.exception("completion %s failed", request_id)
            yield api.encode(writer.fail(StreamFailure(f"stream failed: {exc}", code="internal_error")))
        yield api.DONE
    finally:
        await aclose_shielded(stack)
