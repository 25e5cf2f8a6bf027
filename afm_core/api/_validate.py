"""Typed validators for JSON request bodies, shared by every wire API's parser.

Sans-IO.  Each reads one field of a decoded body (``dict``), checks its type
and range, and returns it typed or raises :class:`RequestError` naming the
field as ``param``.  The messages are OpenAI's style (``'key' must be ...``);
an API with other wording (Anthropic's) uses only the conversions
(:func:`as_float`, :func:`as_whole`) and writes its own messages.

Used by every parser of :mod:`afm_core.api`.
"""

from __future__ import annotations

import math
from typing import Any

from .._errors import RequestError

__all__ = ["as_float", "as_whole", "count", "err", "flag", "include_progress", "include_usage", "integer",
           "json_object", "number", "optional_str", "seed", "stream_option", "valid_text"]


def err(message: str, param: str) -> RequestError:
    """A 400 about ``param``."""
    return RequestError(message, param=param)


def json_object(body: Any) -> dict[str, Any]:
    """``body`` when it is a JSON object (the top level of every request)."""
    if not isinstance(body, dict):
        raise err("the request body must be a JSON object", "body")
    return body


def as_float(v: Any) -> float | None:
    """A JSON number as a float (an integer beyond float range becomes ``inf``); None for a non-number
    (a bool is not a number)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        return float(v)
    except OverflowError:  # an integer beyond float range
        return math.inf


def as_whole(v: Any) -> Any:
    """``v`` with an integral float (``2.0``) made an int; anything else unchanged."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def number(body: dict[str, Any], key: str, lo: float, hi: float, default: float | None) -> float | None:
    """An optional finite number in ``[lo, hi]``."""
    v = body.get(key)
    if v is None:
        return default
    f = as_float(v)
    if f is None:
        raise err(f"'{key}' must be a number", key)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise err(f"'{key}' must be between {lo:g} and {hi:g}", key)
    return f


def integer(body: dict[str, Any], key: str, lo: int, hi: int, default: int | None) -> int | None:
    """An optional integer (an integral float too) in ``[lo, hi]``; type and range have their own messages."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise err(f"'{key}' must be an integer", key)
    if not lo <= v <= hi:
        raise err(f"'{key}' must be between {lo} and {hi}", key)
    return v


def count(body: dict[str, Any], key: str, lo: int, hi: int, default: int | None) -> int | None:
    """An optional integer (an integral float too) in ``[lo, hi]``, with one message for type and range."""
    v = body.get(key)
    if v is None:
        return default
    v = as_whole(v)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise err(f"'{key}' must be an integer between {lo} and {hi}", key)
    return v


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    """An optional boolean."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise err(f"'{key}' must be a boolean", key)
    return v


def optional_str(body: dict[str, Any], key: str) -> str | None:
    """An optional string."""
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise err(f"'{key}' must be a string", key)
    return v


def valid_text(text: str, param: str) -> str:
    """``text`` unless it holds lone surrogates (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise err("text contains invalid unicode (a lone surrogate)", param) from None
    return text


def seed(body: dict[str, Any]) -> int | None:
    """The optional ``seed``: an integer in ``[-2**63, 2**64)``."""
    v = body.get("seed")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise err("'seed' must be an integer", "seed")
    if v is not None and not -(2**63) <= v < 2**64:
        raise err("'seed' is out of range", "seed")
    return v


def stream_option(body: dict[str, Any], key: str) -> bool:
    """A boolean of ``stream_options`` (chat and completions), False when absent."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise err("'stream_options' must be an object", "stream_options")
    value = opts.get(key, False)
    if not isinstance(value, bool):
        raise err(f"'{key}' must be a boolean", f"stream_options.{key}")
    return value


def include_usage(body: dict[str, Any]) -> bool:
    """OpenAI's ``stream_options.include_usage``, False when absent."""
    return stream_option(body, "include_usage")


def include_progress(body: dict[str, Any]) -> bool:
    """afm's ``stream_options.include_progress`` (prompt-progress events), False when absent."""
    return stream_option(body, "include_progress")
