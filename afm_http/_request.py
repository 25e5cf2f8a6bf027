"""Per-request values (kept in quart's ``g``) and reading the request body.

The middleware sets the request id before any route runs; routes read the
body through :func:`read_json`, which notes that the body was read (a
response to an unread body must close the connection, see ``_middleware``).
"""

from __future__ import annotations

from typing import Any

from quart import g, request

from afm_core import ChatRequest, RequestError
from afm_core.api.defaults import Kind, with_model_defaults

from ._body import parse_json
from ._registry import ModelChoice
from ._residency import parse_keep_alive
from ._state import current_state

__all__ = ["PROFILE_HEADER", "PROFILE_MODES", "PROGRESS_HEADER", "body_was_read", "model_choice",
           "profile_mode", "profile_requested", "progress_requested", "read_json", "request_id",
           "request_id_or_none", "sent_a_body", "set_request_id", "skipped_tools_header"]

PROGRESS_HEADER = "X-AFM-Progress"
"""``true`` asks a streamed response of any wire API for prompt-progress events."""

SKIPPED_TOOLS_HEADER = "X-AFM-Skipped-Tools"
"""The tool types of the body not offered to the model (hosted tools afm does not run)."""

PROFILE_HEADER = "X-AFM-Profile"
"""``true`` or ``extended`` asks any generating wire API for the engine's profile
(each API carries it in its own form)."""
PROFILE_MODES = {"true": "basic", "1": "basic", "basic": "basic", "extended": "extended"}
"""Header value -> the engine's ``profile`` mode."""
PROFILE_OFF = ("", "false", "0", "off", "none")

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("", "false", "0", "no", "off")


def set_request_id(rid: str) -> None:
    """Record the current request's id (done first, by the middleware)."""
    g.afm_request_id = rid


def request_id() -> str:
    """The current request's id (a valid client ``X-Request-ID``, or minted)."""
    rid: str = g.afm_request_id
    return rid


def request_id_or_none() -> str | None:
    """The current request's id, or None if the request failed before it was set."""
    rid: str | None = g.get("afm_request_id")
    return rid


_DEFAULTED: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                               "/v1/responses": "responses", "/v1/messages": "anthropic",
                               "/api/chat": "ollama", "/api/generate": "ollama"}
"""The generation routes, and whose fields a model's sampling defaults fill there."""


async def read_json() -> Any:
    """The request body as JSON (413 past ``max_body_bytes``, 400 unless valid JSON);
    on a generation route, with the named model's sampling defaults (an Ollama
    model's ``params``) in the fields the client left out
    (:mod:`afm_core.api.defaults`)."""
    cfg = current_state().config
    if request.content_length is not None and request.content_length > cfg.max_body_bytes:
        raise RequestError(f"the request body exceeds {cfg.max_body_bytes} bytes", status=413,
                           code="request_too_large")
    raw = await request.get_data(cache=False)  # raises 413 past MAX_CONTENT_LENGTH
    g.afm_body_read = True
    body = parse_json(raw, max_depth=cfg.max_json_depth)
    kind = _DEFAULTED.get(request.path.rstrip("/"))
    if kind is None or not isinstance(body, dict):
        return body
    return with_model_defaults(kind, body, current_state().models.defaults_for(body.get("model")))


def model_choice(body: Any) -> ModelChoice:
    """The model a (validated) request body names and its ``keep_alive`` (Ollama's:
    seconds or a duration such as ``"5m"``; 0 unloads the model once idle, negative
    keeps it); a bad ``keep_alive`` is a 400."""
    if not isinstance(body, dict):
        return ModelChoice()
    model = body.get("model")
    keep_alive = body.get("keep_alive")
    if keep_alive is not None:
        try:
            keep_alive = parse_keep_alive(keep_alive)
        except ValueError as exc:
            raise RequestError(str(exc), param="keep_alive") from None
    return ModelChoice(model if isinstance(model, str) else None, keep_alive)


def body_was_read() -> bool:
    """Whether a route read the request body (through :func:`read_json`)."""
    return bool(g.get("afm_body_read"))


def sent_a_body() -> bool:
    """Whether the current request carries a body (a length above 0, or chunked)."""
    if request.content_length:
        return True
    return "chunked" in request.headers.get("Transfer-Encoding", "").lower()


def progress_requested(opted_in: bool = False) -> bool:
    """Whether the response carries prompt-progress events: ``opted_in`` (the
    body's ``stream_options.include_progress``) or the ``X-AFM-Progress`` header."""
    value = request.headers.get(PROGRESS_HEADER)
    if value is None:
        return opted_in
    v = value.strip().lower()
    if v not in _TRUE and v not in _FALSE:
        raise RequestError(f"{PROGRESS_HEADER} must be 'true' or 'false'", param=PROGRESS_HEADER,
                           code="invalid_header")
    return opted_in or v in _TRUE


def profile_mode(value: str | None) -> str | None:
    """The engine's ``profile`` mode (``basic`` / ``extended``) for an
    ``X-AFM-Profile`` value, None for none; any other value is a 400."""
    if value is None or value.strip().lower() in PROFILE_OFF:
        return None
    mode = PROFILE_MODES.get(value.strip().lower())
    if mode is None:
        raise RequestError(f"{PROFILE_HEADER} must be 'true' or 'extended'", param=PROFILE_HEADER,
                           code="invalid_header")
    return mode


def profile_requested() -> str | None:
    """The current request's :func:`profile_mode` (its ``X-AFM-Profile`` header)."""
    return profile_mode(request.headers.get(PROFILE_HEADER))


def skipped_tools_header(chat: ChatRequest) -> dict[str, str]:
    """``X-AFM-Skipped-Tools: web_search,...`` when the request's tools had some afm skipped."""
    return {SKIPPED_TOOLS_HEADER: ",".join(chat.skipped_tools)} if chat.skipped_tools else {}
