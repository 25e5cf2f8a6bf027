"""What every route gets: request ids, the API key check, response headers
(ids, CORS, ``nosniff``, ``Connection: close`` after an unread body), the
status counts behind ``/metrics``, and the error envelope for every failure
raised before a response began: OpenAI's, or Anthropic's on its Messages
paths (``_errors.api_for_path``).  There the key may also come as
``x-api-key`` (what Anthropic's SDKs send), responses carry ``request-id``
too, and CORS allows Anthropic's request headers.  While the server drains,
new generation requests are refused with 503 (``_refuse_while_draining``).
Before all of it, what a web page may not ask (:mod:`._browser`: a foreign
``Origin`` or ``Host`` without a key, a body that is not JSON, a cross-site
``/admin`` request) is refused.

The key is compared as bytes: a header's value arrives as its raw bytes
(HTTP headers are bytes; the server hands them over decoded as Latin-1), so
a key outside ASCII matches what clients send, its UTF-8.
"""

from __future__ import annotations

import hmac
import logging

from quart import Response, request
from werkzeug.exceptions import HTTPException

from afm_core import AFMError

from ._asgi import AFMQuart
from ._browser import BrowserPolicy, refusal
from ._drain import GENERATION_PATHS, RETRY_AFTER_SECONDS
from ._errors import api_for_path, error_response, from_exception, from_http_exception
from ._ids import ID_RULE, client_request_id
from ._request import body_was_read, request_id_or_none, sent_a_body, set_request_id
from ._state import current_state

__all__ = ["CORS_ALLOW_HEADERS", "CORS_EXPOSE_HEADERS", "install"]

log = logging.getLogger("afm.http")

CORS_ALLOW_HEADERS = "Authorization, Content-Type, X-Request-ID, X-AFM-Profile"
CORS_EXPOSE_HEADERS = ("X-Request-ID, OpenAI-Request-ID, X-Grammar-Constraints, X-AFM-Skipped-Tools, "
                       "Retry-After")
ANTHROPIC_CORS_ALLOW_HEADERS = CORS_ALLOW_HEADERS + ", X-Api-Key, Anthropic-Version, Anthropic-Beta"
ANTHROPIC_CORS_EXPOSE_HEADERS = CORS_EXPOSE_HEADERS + ", Request-Id"


def install(app: AFMQuart) -> None:
    """Register the request hooks and error handlers on ``app``."""
    app.before_request(_prepare)
    app.before_request(_refuse_while_draining)  # after the id and key checks
    app.after_request(_finish)
    app.errorhandler(AFMError)(_afm_error)
    app.errorhandler(Exception)(_bug)


async def _refuse_while_draining() -> Response | None:
    """While draining (:mod:`._drain`), a new generation request gets 503 (its
    API's envelope) and ``Retry-After``; everything else goes on (cancel above all)."""
    state = current_state()
    if not state.draining.active or request.method != "POST" or request.path not in GENERATION_PATHS:
        return None
    what = "shutting down" if state.draining.shutting_down else "draining (out of rotation)"
    return error_response(503, f"this server is {what} and takes no new requests: retry "
                               "(through the load balancer, another replica answers)",
                          type="server_error", code="draining",
                          headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                          api=api_for_path(request.path))


def _header_bytes(value: str) -> bytes:
    """A header value's bytes as they came (the server decodes them as Latin-1)."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:  # (not from the wire: nothing there decodes past U+00FF)
        return value.encode("utf-8", "surrogateescape")


def _authorized(header: str | None, api_key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    supplied = _header_bytes(token.strip())
    # compare_digest runs in time independent of where the strings differ
    return hmac.compare_digest(supplied, api_key.encode("utf-8")) and scheme.lower() == "bearer"


def _authorized_key(header: str | None, api_key: str) -> bool:
    """An ``x-api-key`` header (Anthropic's SDKs) holding the key."""
    supplied = _header_bytes((header or "").strip())
    return header is not None and hmac.compare_digest(supplied, api_key.encode("utf-8"))


def _browser_refusal() -> Response | None:
    """The refusal of a request a web page must not make (:mod:`._browser`), if any."""
    state = current_state()
    cfg = state.config
    policy = BrowserPolicy(keyed=cfg.api_key is not None, cors_origins=cfg.cors_origins,
                           allowed_hosts=cfg.allowed_hosts, listen_hosts=state.listen_hosts)
    no = refusal(policy, method=request.method, path=request.path, headers=request.headers,
                 has_body=sent_a_body())
    if no is None:
        return None
    return error_response(no.status, no.message, type=no.type, code=no.code,
                          api=api_for_path(request.path))


def _public(path: str, method: str) -> bool:
    """Served without the API key: ``/health``, and the chat page's own files
    (``GET /``, ``/ui/*``; no data in them: the page sends the key with its API calls)."""
    if path == "/health":
        return True
    return method in ("GET", "HEAD") and current_state().config.ui \
        and (path == "/" or path.startswith("/ui/"))


async def _prepare() -> Response | None:
    rid, valid = client_request_id(request.headers.get("X-Request-ID"))
    set_request_id(rid)
    if (refused := _browser_refusal()) is not None:
        return refused
    if request.method == "OPTIONS":  # CORS preflight never carries credentials
        return None
    api_key = current_state().config.api_key
    api = api_for_path(request.path)
    if api_key is not None and not _public(request.path, request.method) \
            and not _authorized(request.headers.get("Authorization"), api_key) \
            and not (api == "anthropic" and _authorized_key(request.headers.get("X-Api-Key"), api_key)):
        how = "'x-api-key: KEY' or 'Authorization: Bearer KEY'" if api == "anthropic" \
            else "'Authorization: Bearer KEY'"
        return error_response(401, f"missing or invalid API key (send {how})",
                              type="authentication_error", code="invalid_api_key", api=api)
    if not valid:
        return error_response(400, f"X-Request-ID must be {ID_RULE}", param="X-Request-ID",
                              code="invalid_request_id", api=api)
    return None


async def _finish(response: Response) -> Response:
    state = current_state()
    cors_origins = state.config.cors_origins
    rid = request_id_or_none() or client_request_id(None)[0]
    response.headers["X-Request-ID"] = rid
    response.headers["OpenAI-Request-ID"] = rid
    anthropic = api_for_path(request.path) == "anthropic"
    if anthropic:
        response.headers["Request-Id"] = rid  # where Anthropic's SDKs read it
    response.headers["X-Content-Type-Options"] = "nosniff"
    origin = request.headers.get("Origin")
    if cors_origins and origin and ("*" in cors_origins or origin in cors_origins):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Allow-Headers"] = \
            ANTHROPIC_CORS_ALLOW_HEADERS if anthropic else CORS_ALLOW_HEADERS
        response.headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
        response.headers["Access-Control-Expose-Headers"] = \
            ANTHROPIC_CORS_EXPOSE_HEADERS if anthropic else CORS_EXPOSE_HEADERS
        response.headers["Access-Control-Max-Age"] = "600"
        response.headers["Vary"] = "Origin"
    if not body_was_read() and sent_a_body() and request.http_version.startswith("1"):
        # answered without reading the request body (an early 400/401, a 404): hypercorn
        # cannot reuse the connection and closes it after this response.  Say so, or a
        # client that reuses it sees it vanish ("disconnected without a response")
        response.headers["Connection"] = "close"
    state.statuses[response.status_code] += 1
    return response


async def _afm_error(exc: AFMError) -> Response:
    if exc.status >= 500:
        log.warning("request %s: %s", request_id_or_none(), exc.message)
    return from_exception(exc, api=api_for_path(request.path))


async def _bug(exc: Exception) -> Response:
    api = api_for_path(request.path)
    if isinstance(exc, HTTPException):
        return from_http_exception(exc, max_body_bytes=current_state().config.max_body_bytes, api=api)
    if isinstance(exc, AFMError):
        return from_exception(exc, api=api)
    log.exception("request %s: unhandled error", request_id_or_none())
    return error_response(500, "internal server error", type="server_error", code="internal_error",
                          api=api)
