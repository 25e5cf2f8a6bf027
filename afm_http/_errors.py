"""Error responses for every failure before headers are sent.

Every error body is in the envelope of the API whose path was asked
(:func:`api_for_path`, from :data:`ENVELOPES`): OpenAI's ``{"error":
{"message", "type", "param", "code"}}`` (:func:`afm_core.api.chat.error_body`)
by default; Anthropic's ``{"type": "error", "error": {"type", "message"},
"request_id"}`` on the Messages paths (``/v1/messages``, ``/v1/messages/...``)
with Anthropic's statuses (:mod:`afm_core.api.anthropic`: a full queue is 529
``overloaded_error``); Ollama's ``{"error": "..."}`` under ``/api/``.  Core
errors carry their own status hint (``AFMError.status``); werkzeug's routing
errors (404, 405, 413, ...) are mapped here.
"""

from __future__ import annotations

from typing import Literal

from quart import Response
from werkzeug.exceptions import HTTPException

from afm_core import AFMError, DuplicateRequestError, EngineBusyError
from afm_core.api import anthropic, chat, ollama

from ._json import json_response
from ._request import request_id_or_none

__all__ = ["API", "api_for_path", "envelope", "error_response", "from_exception", "from_http_exception"]

API = Literal["openai", "anthropic", "ollama"]

ENVELOPES: tuple[tuple[str, API], ...] = (("/v1/messages", "anthropic"), ("/api/", "ollama"))
"""Path prefixes whose errors use another API's envelope than OpenAI's (a prefix
ending in ``/`` covers everything under it; else the path itself and below)."""

_HTTP_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    431: "headers_too_large",
}


def api_for_path(path: str) -> API:
    """Whose error envelope a request to ``path`` gets."""
    for prefix, api in ENVELOPES:
        if path.startswith(prefix) and (prefix.endswith("/") or path == prefix
                                        or path.startswith(prefix + "/")):
            return api
    return "openai"


envelope = chat.error_body


def error_response(status: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, api: API = "openai") -> Response:
    """An error response; ``api="anthropic"`` gives Anthropic's envelope (its
    ``type`` follows ``status``; ``param`` and ``code`` are not part of it)."""
    headers = dict(headers or {})
    if status == 413:
        # The unread rest of the body must not be parsed as the next request.
        headers["Connection"] = "close"
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
        # a wrong key stays wrong: without this Claude Code retries a 401 ten times
        # with backoff (minutes of silence) where the SDKs' rule stops at once
        headers["x-should-retry"] = "false"
    if api == "anthropic":
        body = anthropic.error_body(message, status=status, request_id=request_id_or_none())
        return json_response(body, status, headers)
    if api == "ollama":
        return json_response(ollama.error_body(message), status, headers)
    return json_response(envelope(message, type=type, param=param, code=code), status, headers)


def from_exception(exc: AFMError, *, api: API = "openai") -> Response:
    """The response for a core error raised before streaming began."""
    headers = {}
    if isinstance(exc, EngineBusyError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    if api == "anthropic":
        if isinstance(exc, DuplicateRequestError):
            headers["x-should-retry"] = "false"  # the SDKs retry 409s: the same id would clash again
        return error_response(anthropic.error_status(exc), exc.message, headers=headers, api=api)
    status = exc.status if 400 <= exc.status <= 599 else 500
    err = exc.to_dict()["error"]
    return error_response(status, err["message"], type=err["type"], param=err["param"],
                          code=err["code"], headers=headers, api=api)


def from_http_exception(exc: HTTPException, *, max_body_bytes: int, api: API = "openai") -> Response:
    """404/405/413/... raised by routing or body reading."""
    status = exc.code or 500
    messages = {
        404: "no such route",
        405: "method not allowed for this route",
        413: f"the request body exceeds {max_body_bytes} bytes",
    }
    message = messages.get(status) or exc.description or exc.name
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return error_response(status, message, type=kind, code=_HTTP_CODES.get(status), api=api)
