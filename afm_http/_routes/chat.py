"""``POST /v1/chat/completions``: OpenAI Chat Completions, streamed or not.

The route turns JSON into a :class:`~afm_core.ChatRequest` and writes the SSE
encoder's bytes, one write per engine step (and the SSE comment
``: keepalive`` while the engine is silent: ``ServerConfig.keepalive_seconds``).  No stream logic lives here: the
engine emits the events, the encoder frames them, the engine's ``collect()``
builds the non-streaming response.

Before headers are sent every failure is an HTTP status with the OpenAI
error envelope; after a stream began, a failure is the encoder's
error-marked chunk followed by ``data: [DONE]``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

from quart import Response, request

from afm_core import ChatRequest, ChatStream, Finish, RequestError, SSEEncoder, StreamFailure, Usage

from .._asgi import AFMQuart
from .._json import json_response
from .._request import read_json, request_id
from .._state import current_state
from .._streaming import (
    KEEPALIVE_FRAME,
    STREAM_HEADERS,
    Keepalive,
    aclose_shielded,
    held_stack,
    keepalive_batches,
)

__all__ = ["register"]

log = logging.getLogger("afm.http")

PROFILE_MODES = {"true": "basic", "1": "basic", "basic": "basic", "extended": "extended"}
PROFILE_OFF = ("", "false", "0", "off", "none")


def register(app: AFMQuart) -> None:
    app.post("/v1/chat/completions")(chat_completions)


async def chat_completions() -> Response:
    state = current_state()
    chat = ChatRequest.from_openai(await read_json())
    profile = _profile_mode(request.headers.get("X-AFM-Profile"))
    rid = request_id()
    stack = held_stack(state, rid)
    stream = await stack.enter_async_context(
        state.engine.stream(chat, request_id=rid, profile=profile))
    headers = {"X-Grammar-Constraints": "downgraded"} if stream.grammar_downgraded else {}
    if not chat.stream:
        async with stack:
            result = await stream.collect()
        return json_response(result, headers=headers)
    body = _sse_body(stream, stack, include_usage=chat.include_usage, request_id=rid,
                     keepalive=state.config.keepalive_seconds)
    return Response(body, status=200, content_type="text/event-stream",
                    headers={**headers, **STREAM_HEADERS})


def _profile_mode(value: str | None) -> str | None:
    if value is None or value.strip().lower() in PROFILE_OFF:
        return None
    mode = PROFILE_MODES.get(value.strip().lower())
    if mode is None:
        raise RequestError("X-AFM-Profile must be 'true' or 'extended'", param="X-AFM-Profile",
                           code="invalid_header")
    return mode


async def _sse_body(stream: ChatStream, stack: AsyncExitStack, *, include_usage: bool,
                    request_id: str, keepalive: float) -> AsyncIterator[bytes]:
    """The SSE body: one write per engine step (a keepalive comment after
    ``keepalive`` silent seconds), then ``[DONE]``; leaves the stream at the end."""
    encoder = SSEEncoder(stream.id, stream.created, stream.model)
    try:
        ended = False
        try:
            async for batch in keepalive_batches(stream, keepalive):
                if isinstance(batch, Keepalive):
                    yield KEEPALIVE_FRAME
                    continue
                if not include_usage:
                    batch = tuple(e for e in batch if type(e) is not Usage)
                ended = ended or any(type(e) in (Finish, StreamFailure) for e in batch)
                if batch:
                    yield encoder.encode_many(batch)
        except Exception as exc:  # headers are sent: report in-band
            log.exception("stream %s failed", request_id)
            yield encoder.encode(StreamFailure(f"stream failed: {exc}", code="internal_error"))
            ended = True
        if not ended:
            # the engine closed the stream without a finish (shutdown): say so
            yield encoder.encode(StreamFailure("the stream ended before it finished",
                                             code="stream_interrupted"))
        yield encoder.done()
    finally:
        await aclose_shielded(stack)
