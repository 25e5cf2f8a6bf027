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
``{"content": "text", "prompt": "text"}`` (llama.cpp's key and vLLM's).

vLLM's shapes are told apart by their keys: ``{"prompt": "text"}``
(``add_special_tokens``, default true as vLLM has it) or a chat body
``{"messages": [...]}`` is answered ``{"count", "max_model_len", "tokens"}``,
with ``"return_token_strs": true`` also ``token_strs`` (each token's text);
a ``messages`` body with ``with_pieces`` keeps llama.cpp's pieces instead.
vLLM's ``GET /tokenizer_info`` is :meth:`Engine.tokenizer_info`.  lm-eval's
``local-completions`` uses these three routes as its tokenizer.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard
library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import RequestError
from ._validate import flag, json_object

__all__ = ["TokenizeCall", "detokenize_result", "parse_detokenize", "parse_tokenize", "tokens_result"]


@dataclass(frozen=True, slots=True)
class TokenizeCall:
    """A validated ``/tokenize`` body: ``content`` text, or ``chat`` (the body) to render;
    ``vllm``: answer in vLLM's shape (``token_strs``: with each token's text)."""

    content: str | None
    chat: dict[str, Any] | None
    add_special: bool
    parse_special: bool
    with_pieces: bool
    vllm: bool = False
    token_strs: bool = False


def parse_tokenize(body: Any) -> TokenizeCall:
    body = json_object(body)
    with_pieces = flag(body, "with_pieces", False)
    token_strs = flag(body, "return_token_strs", False)
    given = [k for k in ("content", "prompt", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise RequestError("give one of 'content' or 'prompt' (text), or 'messages' (a chat)",
                           param=given[1] if len(given) > 1 else "content")
    (key,) = given
    if key == "messages":
        return TokenizeCall(None, body, False, True, with_pieces, vllm=not with_pieces, token_strs=token_strs)
    content = body[key]
    if not isinstance(content, str):
        raise RequestError(f"'{key}' must be a string", param=key)
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"'{key}' contains invalid unicode (a lone surrogate)",
                           param=key) from None
    if key == "prompt":  # vLLM's
        return TokenizeCall(content, None, flag(body, "add_special_tokens", True), True, False,
                            vllm=True, token_strs=token_strs)
    return TokenizeCall(content, None, flag(body, "add_special", False),
                        flag(body, "parse_special", True), with_pieces)


def tokens_result(ids: Sequence[int], pieces: Sequence[bytes] | None, *, call: TokenizeCall | None = None,
                  max_model_len: int = 0) -> dict[str, Any]:
    """The ``/tokenize`` answer; ``pieces`` (each token's bytes) when asked for
    (llama.cpp's ``with_pieces``, vLLM's ``return_token_strs``)."""
    if call is not None and call.vllm:
        out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids)}
        if pieces is not None:
            out["token_strs"] = [p.decode("utf-8", "replace") for p in pieces]
        return out
    if pieces is None:
        return {"tokens": list(ids)}
    return {"tokens": [{"id": i, "piece": _piece(p)} for i, p in zip(ids, pieces, strict=True)]}


def detokenize_result(text: str) -> dict[str, Any]:
    """The ``/detokenize`` answer: llama.cpp reads ``content``, vLLM clients ``prompt``."""
    return {"content": text, "prompt": text}


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
