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
the streams' events into ``text_completion`` chunks, which the driver
(:mod:`afm_http._drive`) writes one write per engine step (the SSE comment
``: keepalive`` while the engine is silent, ``ServerConfig.keepalive_seconds``),
then ``data: [DONE]``; the non-streaming answer folds the same chunks.

Before headers are sent every failure is an HTTP status with the OpenAI
error envelope; after a stream began, a failure is an error chunk followed
by ``data: [DONE]`` (and the other choices stop).  Leaving early (client
disconnect) drops every stream at the next engine step.
"""

from __future__ import annotations

from quart import Response

from afm_core import Engine
from afm_core.api import completions as api

from .._asgi import AFMQuart
from .._drive import check_room, respond
from .._request import model_choice, profile_requested, progress_requested, read_json, request_id
from .._state import current_state
from .._streaming import aclose_shielded, open_model_choices

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.post("/v1/completions")(text_completions)


async def text_completions() -> Response:
    state = current_state()
    body = await read_json()
    call = api.parse(body)
    check_room(state, call.choices, param="prompt", what="choices (prompts times n)")
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
    writer = api.Writer(call, id=first.id, created=first.created, model=first.model, echo=echo,
                        prompt_logprobs=lambda i: streams[i].prompt_logprobs)
    return await respond(state, writer, streams, stack, stream=call.stream, request_id=rid)


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
