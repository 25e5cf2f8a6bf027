"""``POST /tokenize`` and ``POST /detokenize``, as llama.cpp's server has them.

The bodies and answers are :mod:`afm_core.api.tokenize`'s; bad input is a 400
with the OpenAI error envelope.
"""

from __future__ import annotations

from quart import Response

from afm_core.api import tokenize as api

from .._asgi import AFMQuart
from .._json import json_response
from .._request import read_json
from .._state import current_state

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.post("/tokenize")(tokenize_text)
    app.post("/detokenize")(detokenize_tokens)


async def tokenize_text() -> Response:
    engine = current_state().engine
    call = api.parse_tokenize(await read_json())
    if call.chat is not None:
        ids = await engine.tokenize_chat(call.chat)
    else:
        assert call.content is not None
        ids = await engine.tokenize(call.content, add_special_tokens=call.add_special,
                                    parse_special=call.parse_special)
    pieces = await engine.token_pieces(ids) if call.with_pieces else None
    return json_response(api.tokens_result(ids, pieces))


async def detokenize_tokens() -> Response:
    tokens = api.parse_detokenize(await read_json())
    return json_response({"content": await current_state().engine.detokenize(tokens)})
