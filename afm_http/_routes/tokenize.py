"""``POST /tokenize`` and ``POST /detokenize``, as llama.cpp's server has them,
and ``POST /v1/chat/completions/count_tokens``.

The bodies and answers are :mod:`afm_core.api.tokenize`'s; bad input is a 400
with the OpenAI error envelope.  ``count_tokens`` takes a chat completion body
(validated as the chat route does) and answers ``{"input_tokens": N}``, the
prompt tokens of its messages and tools through the chat template, as
Anthropic's ``/v1/messages/count_tokens`` and OpenAI's
``/v1/responses/input_tokens`` count theirs.
"""

from __future__ import annotations

from quart import Response

from afm_core.api import chat
from afm_core.api import tokenize as api

from .._asgi import AFMQuart
from .._json import json_response
from .._request import model_choice, read_json
from .._state import current_state

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.post("/tokenize")(tokenize_text)
    app.post("/detokenize")(detokenize_tokens)
    app.post("/v1/chat/completions/count_tokens")(count_chat_tokens)


async def tokenize_text() -> Response:
    body = await read_json()
    call = api.parse_tokenize(body)
    async with current_state().engine_for(model_choice(body)) as engine:
        if call.chat is not None:
            ids = await engine.tokenize_chat(call.chat)
        else:
            assert call.content is not None
            ids = await engine.tokenize(call.content, add_special_tokens=call.add_special,
                                        parse_special=call.parse_special)
        pieces = await engine.token_pieces(ids) if call.with_pieces else None
    return json_response(api.tokens_result(ids, pieces))


async def detokenize_tokens() -> Response:
    body = await read_json()
    tokens = api.parse_detokenize(body)
    async with current_state().engine_for(model_choice(body)) as engine:
        return json_response({"content": await engine.detokenize(tokens)})


async def count_chat_tokens() -> Response:
    body = await read_json()
    request = chat.parse(body)
    async with current_state().engine_for(model_choice(body)) as engine:
        ids = await engine.tokenize_chat(request)
    return json_response({"input_tokens": len(ids)})
