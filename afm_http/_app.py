"""The OpenAI-compatible HTTP adapter (quart-trio).

Routes turn JSON into :class:`~afm_core.ChatRequest` and write the
SSE encoder's bytes, one write per engine step.  No stream logic lives here:
the engine emits the events, the encoder frames them, the accumulator builds
the non-streaming response.

Before headers are sent every failure is an HTTP status with the OpenAI
error envelope; after a stream began, a failure is the encoder's
error-marked chunk followed by ``data: [DONE]``.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response, g, request
from werkzeug.exceptions import HTTPException

from afm_core import (
    AFMError,
    ChatRequest,
    ChatStream,
    Engine,
    Finish,
    RequestError,
    SSEEncoder,
    StreamError,
    Usage,
    runtime_info,
)

from . import _metrics
from ._asgi import AFMQuart, close_when_done
from ._body import MAX_DEPTH, parse_json
from ._errors import error_response, from_exception, from_http_exception
from ._ids import ID_RULE, InFlight, client_request_id, valid_request_id
from ._json import json_response

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger("afm.http")

PROFILE_MODES = {"true": "basic", "1": "basic", "basic": "basic", "extended": "extended"}
PROFILE_OFF = ("", "false", "0", "off", "none")
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CORS_ALLOW_HEADERS = "Authorization, Content-Type, X-Request-ID, X-AFM-Profile"
CORS_EXPOSE_HEADERS = "X-Request-ID, OpenAI-Request-ID, X-Grammar-Constraints, Retry-After"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-layer options (the engine has its own :class:`EngineConfig`)."""

    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 8 << 20
    max_json_depth: int = MAX_DEPTH
    body_timeout: float = 60.0


def _authorized(header: str | None, api_key: str) -> bool:
    scheme, _, token = (header or "").partition(" ")
    supplied = token.strip().encode("utf-8", "surrogateescape")
    # compare_digest runs in time independent of where the strings differ
    return hmac.compare_digest(supplied, api_key.encode("utf-8")) and scheme.lower() == "bearer"


def _sent_a_body() -> bool:
    """Whether the current request carries a body (a length above 0, or chunked)."""
    if request.content_length:
        return True
    return "chunked" in request.headers.get("Transfer-Encoding", "").lower()


def _profile_mode(value: str | None) -> str | None:
    if value is None or value.strip().lower() in PROFILE_OFF:
        return None
    mode = PROFILE_MODES.get(value.strip().lower())
    if mode is None:
        raise RequestError("X-AFM-Profile must be 'true' or 'extended'", param="X-AFM-Profile",
                           code="invalid_header")
    return mode


async def _sse_body(stream: ChatStream, stack: AsyncExitStack, *, include_usage: bool,
                    request_id: str) -> AsyncIterator[bytes]:
    """The SSE body: one write per engine step, then ``[DONE]``; leaves the stream at the end."""
    encoder = SSEEncoder(stream.id, stream.created, stream.model)
    try:
        ended = False
        try:
            async for batch in stream.batches():
                if not include_usage:
                    batch = tuple(e for e in batch if type(e) is not Usage)
                ended = ended or any(type(e) in (Finish, StreamError) for e in batch)
                if batch:
                    yield encoder.encode_many(batch)
        except Exception as exc:  # headers are sent: report in-band
            log.exception("stream %s failed", request_id)
            yield encoder.encode(StreamError(f"stream failed: {exc}", code="internal_error"))
            ended = True
        if not ended:
            # the engine closed the stream without a finish (shutdown): say so
            yield encoder.encode(StreamError("the stream ended before it finished",
                                             code="stream_interrupted"))
        yield encoder.done()
    finally:
        with trio.CancelScope(shield=True):
            await stack.aclose()


def create_app(engine: Engine, config: ServerConfig | None = None) -> AFMQuart:
    """The ASGI app serving ``engine`` (run it with hypercorn's trio worker)."""
    cfg = config or ServerConfig()
    app = AFMQuart("afm")
    app.config.update(
        MAX_CONTENT_LENGTH=cfg.max_body_bytes,
        RESPONSE_TIMEOUT=None,
        BODY_TIMEOUT=cfg.body_timeout,
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    statuses: Counter[int] = Counter()
    inflight = app.afm_inflight = InFlight()

    def drain() -> int:
        """Cancel every request this app has open; each stream ends "cancelled", then [DONE]."""
        return sum(engine.cancel(rid) for rid in inflight.ids())

    app.afm_drain = drain

    @app.before_request
    async def _prepare() -> Response | None:
        rid, valid = client_request_id(request.headers.get("X-Request-ID"))
        g.afm_request_id = rid
        if request.method == "OPTIONS":  # CORS preflight never carries credentials
            return None
        if cfg.api_key is not None and request.path != "/health" \
                and not _authorized(request.headers.get("Authorization"), cfg.api_key):
            return error_response(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                  type="authentication_error", code="invalid_api_key")
        if not valid:
            return error_response(400, f"X-Request-ID must be {ID_RULE}", param="X-Request-ID",
                                  code="invalid_request_id")
        return None

    @app.after_request
    async def _finish(response: Response) -> Response:
        rid = getattr(g, "afm_request_id", None) or client_request_id(None)[0]
        response.headers["X-Request-ID"] = rid
        response.headers["OpenAI-Request-ID"] = rid
        response.headers["X-Content-Type-Options"] = "nosniff"
        origin = request.headers.get("Origin")
        if cfg.cors_origins and origin and ("*" in cfg.cors_origins or origin in cfg.cors_origins):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Headers"] = CORS_ALLOW_HEADERS
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSE_HEADERS
            response.headers["Access-Control-Max-Age"] = "600"
            response.headers["Vary"] = "Origin"
        if not g.get("afm_body_read") and _sent_a_body() and request.http_version.startswith("1"):
            # answered without reading the request body (an early 400/401, a 404): hypercorn
            # cannot reuse the connection and closes it after this response.  Say so, or a
            # client that reuses it sees it vanish ("disconnected without a response")
            response.headers["Connection"] = "close"
        statuses[response.status_code] += 1
        return response

    @app.errorhandler(AFMError)
    async def _afm_error(exc: AFMError) -> Response:
        if exc.status >= 500:
            log.warning("request %s: %s", g.get("afm_request_id"), exc.message)
        return from_exception(exc)

    @app.errorhandler(Exception)
    async def _bug(exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            return from_http_exception(exc, max_body_bytes=cfg.max_body_bytes)
        if isinstance(exc, AFMError):
            return from_exception(exc)
        log.exception("request %s: unhandled error", g.get("afm_request_id"))
        return error_response(500, "internal server error", type="server_error", code="internal_error")

    async def read_json() -> Any:
        if request.content_length is not None and request.content_length > cfg.max_body_bytes:
            raise RequestError(f"the request body exceeds {cfg.max_body_bytes} bytes", status=413,
                               code="request_too_large")
        raw = await request.get_data(cache=False)  # raises 413 past MAX_CONTENT_LENGTH
        g.afm_body_read = True
        return parse_json(raw, max_depth=cfg.max_json_depth)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        chat = ChatRequest.from_openai(await read_json())
        profile = _profile_mode(request.headers.get("X-AFM-Profile"))
        rid: str = g.afm_request_id
        stack = AsyncExitStack()
        close_when_done(stack)  # also closed if the body below never runs
        stack.enter_context(inflight.hold(rid))
        stream = await stack.enter_async_context(
            engine.stream(chat, request_id=rid, profile=profile))
        headers = {"X-Grammar-Constraints": "downgraded"} if stream.grammar_downgraded else {}
        if not chat.stream:
            async with stack:
                result = await stream.collect()
            return json_response(result, headers=headers)
        body = _sse_body(stream, stack, include_usage=chat.include_usage, request_id=rid)
        return Response(body, status=200, content_type="text/event-stream",
                        headers={**headers, **STREAM_HEADERS})

    @app.post("/v1/chat/completions/<path:target>/cancel")
    async def cancel(target: str) -> Response:
        cancelled = valid_request_id(target) and engine.cancel(target)
        body = {"id": target, "object": "chat.completion.cancellation", "cancelled": bool(cancelled)}
        return json_response(body, 200 if cancelled else 404)

    def model_card() -> dict[str, Any]:
        return {
            "id": engine.model_id,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "afm",
            "context_length": engine.context_length,
            "max_model_len": engine.context_length,
        }

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id != engine.model_id:
            return error_response(404, "no such model", param="model", code="model_not_found")
        return json_response(model_card())

    @app.get("/health")
    async def health() -> Response:
        stats = engine.statistics()
        ok = engine.healthy
        info = runtime_info()
        return json_response({"status": "ok" if ok else "unavailable", "model": engine.model_id,
                              "running": stats.running, "waiting": stats.waiting,
                              "blas": info.blas, "quantized_kernel": info.quantized_kernel,
                              "compiled": info.compiled},
                             status=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = _metrics.render(engine.statistics(), engine.model_id, dict(statuses))
        return Response(text, content_type=_metrics.CONTENT_TYPE)

    return app
