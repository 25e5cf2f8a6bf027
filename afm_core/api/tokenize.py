"""llama.cpp's ``/tokenize`` and ``/detokenize`` bodies, validated (sans-IO).

``/tokenize`` takes ``{"content": "text"}`` (``add_special``, default false:
add what the tokenizer adds around a text, such as a BOS; ``parse_special``,
default true: special-token spellings in the text become their tokens) or a
chat body ``{"messages": [...], "tools": [...]}`` (rendered with the model's
chat template by :meth:`Engine.tokenize_chat`), and answers
``{"tokens": [ids]}``; with ``"with_pieces": true`` each token is
``{"id", "piece"}``, the piece being the token's text, or its bytes as a
list of numbers when they are not valid UTF-8 on their own.
``/detokenize`` takes ``{"tokens": [ids]}`` and answers
``{"content": "text"}``.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard
library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import RequestError
from ._validate import flag, json_object

__all__ = ["TokenizeCall", "parse_detokenize", "parse_tokenize", "tokens_result"]


@dataclass(frozen=True, slots=True)
class TokenizeCall:
    """A validated ``/tokenize`` body: ``content`` text, or ``chat`` (the body) to render."""

    content: str | None
    chat: dict[str, Any] | None
    add_special: bool
    parse_special: bool
    with_pieces: bool


def parse_tokenize(body: Any) -> TokenizeCall:
    body = json_object(body)
    with_pieces = flag(body, "with_pieces", False)
    has_content, has_messages = body.get("content") is not None, body.get("messages") is not None
    if has_content == has_messages:
        raise RequestError("give either 'content' (text) or 'messages' (a chat)", param="content")
    if has_messages:
        return TokenizeCall(None, body, False, True, with_pieces)
    content = body["content"]
    if not isinstance(content, str):
        raise RequestError("'content' must be a string", param="content")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError("'content' contains invalid unicode (a lone surrogate)",
                           param="content") from None
    return TokenizeCall(content, None, flag(body, "add_special", False),
                        flag(body, "parse_special", True), with_pieces)


def tokens_result(ids: Sequence[int], pieces: Sequence[bytes] | None) -> dict[str, Any]:
    """The ``/tokenize`` answer; ``pieces`` (each token's bytes) when asked for."""
    if pieces is None:
        return {"tokens": list(ids)}
    return {"tokens": [{"id": i, "piece": _piece(p)} for i, p in zip(ids, pieces, strict=True)]}


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def parse_detokenize(body: Any) -> list[Any]:
    """The ``tokens`` of a ``/detokenize`` body (the engine checks each id)."""
    tokens = json_object(body).get("tokens")
    if not isinstance(tokens, list):
        raise RequestError("'tokens' must be an array of token ids", param="tokens")
    return tokens
