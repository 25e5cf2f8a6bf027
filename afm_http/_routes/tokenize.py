"""``POST /tokenize`` and ``POST /detokenize``, as llama.cpp's server has them.

``/tokenize`` takes ``{"content": "text"}`` (``add_special``, default false:
add what the tokenizer adds around a text, such as a BOS; ``parse_special``,
default true: special-token spellings in the text become their tokens) or a
chat body ``{"messages": [...], "tools": [...]}`` (rendered with the model's
chat template: the prompt a chat request would generate from, so
``len(tokens)`` is its token count), and answers ``{"tokens": [ids]}``; with
``"with_pieces": true`` each token is ``{"id", "piece"}``, the piece being
the token's text, or its bytes as a list of numbers when they are not valid
UTF-8 on their own.  ``/detokenize`` takes ``{"tokens": [ids]}`` and answers
``{"content": "text"}`` (special tokens spelled out).  Bad input is a 400
with the OpenAI error envelope.
"""

from __future__ import annotations

from typing import Any

from quart import Response

from afm_core import RequestError

from .._asgi import AFMQuart
from .._json import json_response
from .._request import read_json
from .._state import current_state

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.post("/tokenize")(tokenize_text)
    app.post("/detokenize")(detokenize_tokens)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", param="body")
    return body


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{key}' must be a boolean", param=key)
    return v


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def tokenize_text() -> Response:
    engine = current_state().engine
    body = _object(await read_json())
    with_pieces = _flag(body, "with_pieces", False)
    has_content, has_messages = body.get("content") is not None, body.get("messages") is not None
    if has_content == has_messages:
        raise RequestError("give either 'content' (text) or 'messages' (a chat)", param="content")
    if has_messages:
        ids = await engine.tokenize_chat(body)
    else:
        content = body["content"]
        if not isinstance(content, str):
            raise RequestError("'content' must be a string", param="content")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError("'content' contains invalid unicode (a lone surrogate)",
                               param="content") from None
        ids = await engine.tokenize(content, add_special_tokens=_flag(body, "add_special", False),
                                    parse_special=_flag(body, "parse_special", True))
    if not with_pieces:
        return json_response({"tokens": ids})
    pieces = await engine.token_pieces(ids)
    return json_response({"tokens": [{"id": i, "piece": _piece(p)} for i, p in zip(ids, pieces, strict=True)]})


async def detokenize_tokens() -> Response:
    engine = current_state().engine
    body = _object(await read_json())
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise RequestError("'tokens' must be an array of token ids", param="tokens")
    return json_response({"content": await engine.detokenize(tokens)})
