"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic Messages.

The translation (:mod:`afm_core.api.anthropic`) validates the body into the
engine's request and turns the engine's events into Anthropic's stream
events; this module opens the stream and hands its writer to the driver
(:mod:`afm_http._drive`: in-flight registry, one write per engine step,
``close_when_done``), which writes ``event: NAME`` / ``data: {...}`` frames: ``message_start`` and a ``ping``
first, a ``ping`` whenever the engine has been silent for
``ServerConfig.keepalive_seconds`` (queued, or a long prefill; 0: none), then the blocks, ``message_delta``
and ``message_stop``.  A matched stop sequence cancels the engine request
(the translation matches them; see its docstring).  ``X-AFM-Profile`` adds
an ``afm_profile`` event between ``message_delta`` and ``message_stop``
(``{"type": "afm_profile", "afm_profile": {...}}``, or
``afm_profile_extended``), and a top-level field of the non-streaming message.

``max_tokens`` beyond what the context leaves after the prompt is served
with the room there is (``stop_reason: "model_context_window_exceeded"``
when it fills up), as Anthropic's recent models do; a prompt beyond the
context is Anthropic's 400 "prompt is too long: N tokens > M maximum".

Errors before the stream began use Anthropic's envelope (the middleware
chooses it by path); after, an ``event: error`` ends the stream.
"""

from __future__ import annotations

import dataclasses
from contextlib import AsyncExitStack

from quart import Response

from afm_core import ChatRequest, ChatStream, ContextLengthError, Engine
from afm_core.api import anthropic

from .._asgi import AFMQuart
from .._drive import respond
from .._json import json_response
from .._request import (
    model_choice,
    profile_requested,
    progress_requested,
    read_json,
    request_id,
    skipped_tools_header,
)
from .._state import current_state
from .._streaming import held_engine

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.post("/v1/messages")(create_message)
    app.post("/v1/messages/count_tokens")(count_message_tokens)


async def create_message() -> Response:
    state = current_state()
    body = await read_json()
    req = anthropic.parse_request(body)
    profile = profile_requested()
    progress = req.stream and progress_requested()
    rid = request_id()
    stack, engine = await held_engine(state, model_choice(body), rid)
    stream = await _open(engine, stack, req.chat, rid, profile=profile, progress=progress)
    writer = anthropic.Writer(anthropic.MessageStream(
        model=req.model, input_tokens=stream.prompt_tokens, stop_sequences=req.stop_sequences,
        context_length=engine.context_length, show_thinking=req.show_thinking,
        profile=profile is not None), stream=req.stream)
    headers = {"X-Grammar-Constraints": "downgraded"} if stream.grammar_downgraded else {}
    headers.update(skipped_tools_header(req.chat))
    return await respond(state, writer, [stream], stack, stream=req.stream, request_id=rid,
                         headers=headers, cancel=lambda: engine.cancel(rid))


async def count_message_tokens() -> Response:
    body = await read_json()
    chat = anthropic.parse_count_tokens(body)
    async with current_state().engine_for(model_choice(body)) as engine:
        ids = await engine.tokenize_chat(chat)
    return json_response(anthropic.count_tokens_result(len(ids)))


async def _open(engine: Engine, stack: AsyncExitStack, chat: ChatRequest, rid: str, *,
                profile: str | None, progress: bool) -> ChatStream:
    """Enter ``engine.stream``; a ``max_tokens`` beyond the context's room becomes the room."""
    if chat.max_tokens is not None and chat.max_tokens >= engine.context_length:
        chat = dataclasses.replace(chat, max_tokens=None)  # never fits (Claude Code asks 32000+)
    try:
        return await stack.enter_async_context(engine.stream(chat, request_id=rid, profile=profile,
                                                             progress=progress))
    except ContextLengthError as exc:
        if exc.param == "messages":
            tokens = len(await engine.tokenize_chat(chat))
            raise anthropic.prompt_too_long(tokens, engine.context_length) from None
        if exc.param != "max_tokens":
            raise
    return await stack.enter_async_context(
        engine.stream(dataclasses.replace(chat, max_tokens=None), request_id=rid, profile=profile,
                      progress=progress))
