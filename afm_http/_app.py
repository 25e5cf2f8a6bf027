"""The OpenAI-compatible HTTP adapter (quart-trio).

Routes convert JSON into :class:`afm_core.ChatRequest` and write the SSE
encoder's bytes, one write per engine step.  No stream logic lives here.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from afm_core._engine import Engine
from afm_core._errors import AFMError, RequestError
from afm_core._events import StreamError, Usage
from afm_core._request import ChatRequest
from afm_core._sse import SSEEncoder

from . import _metrics
from ._errors import error_response, from_exception
from ._ids import mint_request_id, valid_request_id

log = logging.getLogger("afm.http")

PROFILE_MODES = {"true": "basic", "1": "basic", "basic": "basic", "extended": "extended"}


@dataclass(frozen=True, slots=True)
class ServerConfig:
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 8 << 20
    max_json_depth: int = 64


def _reject_constant(value: str) -> Any:
    raise ValueError(f"{value} is not valid JSON")


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of ``obj`` (stops counting past ``limit``)."""
    stack = [(obj, 1)]
    deepest = 0
    while stack:
        item, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return deepest


def create_app(engine: Engine, config: ServerConfig | None = None) -> QuartTrio:
    cfg = config or ServerConfig()
    app = QuartTrio("afm")
    app.config.update(
        MAX_CONTENT_LENGTH=cfg.max_body_bytes,
        RESPONSE_TIMEOUT=None,
        BODY_TIMEOUT=60,
        PROVIDE_AUTOMATIC_OPTIONS=True,
    )
    statuses: Counter[int] = Counter()

    def request_id() -> str:
        return getattr(request, "afm_request_id", None) or mint_request_id()

    @app.before_request
    async def _prepare() -> Response | None:
        rid = request.headers.get("X-Request-ID")
        if rid is not None and not valid_request_id(rid):
            request.afm_request_id = mint_request_id()  # type: ignore[attr-defined]
            return error_response(400, "X-Request-ID must be 1-128 characters of [A-Za-z0-9._:-]",
                                  param="X-Request-ID", code="invalid_request_id")
        request.afm_request_id = rid or mint_request_id()  # type: ignore[attr-defined]
        if request.method == "OPTIONS":
            return None
        if cfg.api_key is not None and request.path != "/health":
            auth = request.headers.get("Authorization", "")
            scheme, _, token = auth.partition(" ")
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode("utf-8", "surrogateescape"), cfg.api_key.encode("utf-8"))
            if not ok:
                return error_response(401, "missing or invalid API key", type="authentication_error",
                                      code="invalid_api_key")
        return None

    @app.after_request
    async def _finish(response: Response) -> Response:
        rid = request_id()
        response.headers["X-Request-ID"] = rid
        response.headers["OpenAI-Request-ID"] = rid
        origin = request.headers.get("Origin")
        if cfg.cors_origins and origin and ("*" in cfg.cors_origins or origin in cfg.cors_origins):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Headers"] = (
                "Authorization, Content-Type, X-Request-ID, X-AFM-Profile")
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Access-Control-Expose-Headers"] = (
                "X-Request-ID, OpenAI-Request-ID, X-Grammar-Constraints")
            response.headers["Vary"] = "Origin"
        statuses[response.status_code] += 1
        return response

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        messages = {404: "no such route", 405: "method not allowed",
                    413: f"request body exceeds {cfg.max_body_bytes} bytes"}
        return error_response(code, messages.get(code, exc.description or exc.name),
                              code={404: "not_found", 405: "method_not_allowed",
                                    413: "request_too_large"}.get(code))

    @app.errorhandler(AFMError)
    async def _afm_error(exc: AFMError) -> Response:
        return from_exception(exc)

    @app.errorhandler(Exception)
    async def _bug(exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            return await _http_error(exc)
        log.exception("unhandled error")
        return error_response(500, "internal server error", type="server_error", code="internal_error")

    async def read_json() -> Any:
        if request.content_length is not None and request.content_length > cfg.max_body_bytes:
            raise RequestError(f"request body exceeds {cfg.max_body_bytes} bytes",
                               status=413, code="request_too_large")
        raw = await request.get_data(cache=False)
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            body = json.loads(text, parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}", param="body",
                               code="invalid_json") from None
        if _depth(body, cfg.max_json_depth) > cfg.max_json_depth:
            raise RequestError(f"JSON nested deeper than {cfg.max_json_depth} levels", param="body")
        return body

    def profile_mode() -> str | None:
        value = request.headers.get("X-AFM-Profile")
        if value is None or value.lower() in ("", "false", "0", "off"):
            return None
        mode = PROFILE_MODES.get(value.lower())
        if mode is None:
            raise RequestError("X-AFM-Profile must be 'true' or 'extended'", param="X-AFM-Profile")
        return mode

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        body = await read_json()
        chat = ChatRequest.from_openai(body)
        profile = profile_mode()
        rid = request_id()
        stack = AsyncExitStack()
        stream = await stack.enter_async_context(
            engine.stream(chat, request_id=rid, profile=profile))
        headers = {}
        if stream.grammar_downgraded:
            headers["X-Grammar-Constraints"] = "downgraded"
        if not chat.stream:
            try:
                result = await stream.collect()
            finally:
                await stack.aclose()
            return Response(json.dumps(result, ensure_ascii=False), status=200,
                            content_type="application/json", headers=headers)
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return Response(_sse_body(stream, stack, chat.include_usage), status=200,
                        content_type="text/event-stream", headers=headers)

    async def _sse_body(stream: Any, stack: AsyncExitStack, include_usage: bool) -> Any:
        encoder = SSEEncoder(stream.id, stream.created, stream.model)
        try:
            try:
                async for batch in stream.batches():
                    if not include_usage:
                        batch = tuple(e for e in batch if type(e) is not Usage)
                    if batch:
                        yield encoder.encode_many(batch)
            except (trio.Cancelled, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band
                log.exception("stream failed")
                yield encoder.encode(StreamError(f"stream failed: {exc}", code="internal_error"))
            yield encoder.done()
        finally:
            with trio.CancelScope(shield=True):
                await stack.aclose()

    @app.post("/v1/chat/completions/<path:request_id_>/cancel")
    async def cancel(request_id_: str) -> Response:
        cancelled = valid_request_id(request_id_) and engine.cancel(request_id_)
        body = {"id": request_id_, "object": "chat.completion.cancellation", "cancelled": bool(cancelled)}
        return Response(json.dumps(body), status=200 if cancelled else 404,
                        content_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        info = {
            "id": engine.model_id,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "afm",
            "context_length": engine.context_length,
            "max_model_len": engine.context_length,
        }
        return Response(json.dumps({"object": "list", "data": [info]}), content_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        stats = engine.statistics()
        return Response(json.dumps({"status": "ok", "model": engine.model_id,
                                    "running": stats.running, "waiting": stats.waiting}),
                        content_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        text = _metrics.render(engine.statistics(), engine.model_id, dict(statuses))
        return Response(text, content_type="text/plain; version=0.0.4")

    return app
