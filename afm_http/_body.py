"""Decode a request body into JSON, strictly and without surprises.

Everything that is not plain, finite, well-formed UTF-8 JSON becomes a
:class:`RequestError` (HTTP 400), never another exception: invalid UTF-8,
syntax errors, ``NaN``/``Infinity`` literals, numbers that overflow a float
(``1e400``, also an integer literal beyond a float's range) or have more
digits than Python parses, lone UTF-16 surrogates (``"\\ud800"``, not text
at all; tokenizers crash on them) and nesting deeper than ``max_depth``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from afm_core import RequestError

__all__ = ["MAX_DEPTH", "parse_json"]

MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Invalid(ValueError):
    pass


def _reject_constant(value: str) -> Any:
    raise _Invalid(f"{value} is not valid JSON")


def _bounded_int(value: str) -> int:
    number = int(value)  # ValueError past int_max_str_digits
    if len(value) > 300:
        try:
            float(number)
        except OverflowError:
            raise _Invalid(f"the number {value[:32]}... is out of range") from None
    return number


def _finite_float(value: str) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise _Invalid(f"the number {value[:32]} is out of range")
    return number


def _invalid(message: str) -> RequestError:
    return RequestError(message, param="body", code="invalid_json")


def _check(obj: Any, max_depth: int) -> None:
    """Reject nesting deeper than ``max_depth`` and strings with lone surrogates."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise _invalid("the request body contains a lone UTF-16 surrogate escape")
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > max_depth:
            raise _invalid(f"the request body is nested deeper than {max_depth} levels")
        if isinstance(item, dict):
            for key, value in item.items():
                stack.append((key, depth))
                stack.append((value, depth + 1))
        else:
            stack.extend((value, depth + 1) for value in item)


def parse_json(raw: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of ``raw``; :class:`RequestError` (400) for anything invalid."""
    if not raw:
        raise _invalid("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise _invalid(f"the request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float,
                           parse_int=_bounded_int)
    except RecursionError:
        raise _invalid(f"the request body is nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise _invalid(f"the request body is not valid JSON: {exc.msg} "
                       f"(line {exc.lineno}, column {exc.colno})") from None
    except ValueError as exc:  # _Invalid, or an integer beyond int_max_str_digits
        raise _invalid(f"the request body is not valid JSON: {exc}") from None
    _check(value, max_depth)
    return value
