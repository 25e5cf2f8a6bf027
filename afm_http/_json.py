"""JSON bodies: compact UTF-8, byte for byte what afm_core's SSE encoder writes.

``dumps(obj)`` equals ``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))``
encoded as UTF-8, except that a lone surrogate, which UTF-8 cannot carry, is
written as its ``\\udXXX`` escape (lower-case hex) instead of crashing: the
``backslashreplace`` error handler writes exactly that, and with
``ensure_ascii=False`` surrogates only occur inside JSON strings.
"""

from __future__ import annotations

import json
from typing import Any

from quart import Response

__all__ = ["dumps", "json_response"]


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON of ``obj`` (lone surrogates escaped)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``obj`` as compact UTF-8 JSON (lone surrogates escaped, never a crash)."""
    return Response(dumps(obj), status=status, content_type="application/json", headers=headers or {})
