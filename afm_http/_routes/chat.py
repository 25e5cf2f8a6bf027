"""``POST /v1/chat/completions``: OpenAI Chat Completions, streamed or not.

The translation is :mod:`afm_core.api.chat` (the body into a
:class:`~afm_core.ChatRequest`, the events into chunks or the
``chat.completion``); the driver (:mod:`afm_http._drive`) writes one write
per engine step, the SSE comment ``: keepalive`` while the engine is silent
(``ServerConfig.keepalive_seconds``), then ``data: [DONE]``.

``n`` > 1 runs each choice as its own engine stream, all at once (the
engine prefills the shared prompt once): choice 0 under the client's request
id, choice ``i`` as ``<id>/<i>`` in its group, so
``POST /v1/chat/completions/{id}/cancel`` ends every choice with
``finish_reason: "cancelled"``; with a ``seed``, choice ``i`` samples with
``seed + i``.  The usage (one chunk after every choice finished, when
``stream_options.include_usage`` asks; always in the non-streaming answer)
counts the prompt once and the completion tokens of every choice.
``X-AFM-Profile`` profiles choice 0 only: its one ``afm_profile`` object
comes after the usage, before ``[DONE]``.  ``stream_options.include_progress``
(or the ``X-AFM-Progress: true`` header) adds prompt-progress chunks
(``choices: []``, ``prompt_progress``) while choice 0's prompt is prefilled.

Before headers are sent every failure is an HTTP status with the OpenAI
error envelope; after a stream began, a failure is an error-marked chunk
followed by ``data: [DONE]`` (a failing choice stops the others, and no
usage follows).  Leaving early (client disconnect) drops every choice at
the next engine step.
"""

from __future__ import annotations

from quart import Response

from afm_core.api import chat

from .._asgi import AFMQuart
from .._drive import check_room, respond
from .._request import (
    model_choice,
    profile_requested,
    progress_requested,
    read_json,
    request_id,
    skipped_tools_header,
)
from .._state import current_state
from .._streaming import open_model_choices

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.post("/v1/chat/completions")(chat_completions)


async def chat_completions() -> Response:
    state = current_state()
    body = await read_json()
    request = chat.parse(body)
    check_room(state, request.n, param="n")
    profile = profile_requested()
    progress = request.stream and progress_requested(request.include_progress)
    rid = request_id()
    stack, _, streams = await open_model_choices(state, model_choice(body), request.per_choice(), rid,
                                                 profile=profile, progress=progress)
    first = streams[0]
    writer = chat.Writer(id=first.id, created=first.created, model=first.model, choices=len(streams),
                         stream=request.stream, include_usage=request.include_usage)
    downgraded = any(s.grammar_downgraded for s in streams)
    headers = {"X-Grammar-Constraints": "downgraded"} if downgraded else {}
    headers.update(skipped_tools_header(request))
    return await respond(state, writer, streams, stack, stream=request.stream, request_id=rid,
                         headers=headers)
