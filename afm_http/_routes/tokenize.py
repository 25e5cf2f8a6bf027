"""``POST /tokenize`` and ``POST /detokenize``, as llama.cpp's and vLLM's servers
have them (told apart by the body's keys), vLLM's ``GET /tokenizer_info``, and
``POST /v1/chat/completions/count_tokens``.

The bodies and answers are :mod:`afm_core.api.tokenize`'s; bad input is a 400
with the OpenAI error envelope.  ``count_tokens`` takes a chat completion body
(validated as the chat route does) and answers ``{"input_tokens": N}``, the
prompt tokens of its messages and tools through the chat template, as
Anthropic's ``/v1/messages/count_tokens`` and OpenAI's
``/v1/responses/input_tokens`` count theirs.
"""

from __future__ import annotations

from quart import Response, request

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
    app.get("/tokenizer_info")(tokenizer_info)
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
        pieces = await engine.token_pieces(ids) if call.with_pieces or call.token_strs else None
        return json_response(api.tokens_result(ids, pieces, call=call, max_model_len=engine.context_length))


async def detokenize_tokens() -> Response:
    body = await read_json()
    tokens = api.parse_detokenize(body)
    async with current_state().engine_for(model_choice(body)) as engine:
        return json_response(api.detokenize_result(await engine.detokenize(tokens)))


async def tokenizer_info() -> Response:
    """vLLM's tokenizer description (``?model=`` picks the model); lm-eval probes it."""
    async with current_state().engine_for(model_choice({"model": request.args.get("model")})) as engine:
        return json_response(engine.tokenizer_info())


async def count_chat_tokens() -> Response:
    body = await read_json()
    request = chat.parse(body)
    async with current_state().engine_for(model_choice(body)) as engine:
        ids = await engine.tokenize_chat(request)
    return json_response({"input_tokens": len(ids)})
