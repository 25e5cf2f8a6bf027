"""Readiness and operations: ``GET /health``, ``GET /metrics``, ``/admin/drain``.

``GET /health`` (liveness, load and compute back-ends) is what a load
balancer checks: 200 when ready; 503 with ``"status": "unavailable"`` (and
the reason in ``"error"``) if the generation thread died (or, under
``--distributed``, lost another rank), or ``"status": "draining"`` (and the drain's reason
and time left) while the replica drains.  With several models, ``"models"`` gives
each one's state; a model not loaded (it loads on first use) leaves the server
ready, and the counts add up every loaded model's (with one model the
answer is as it always was, without ``"models"``).  With ``--kv-bits``,
``"kv_cache"`` says the KV cache is quantized (``{"bits": 8, "group_size": 64}``).  ``GET /metrics`` is
Prometheus text (per-model load state, loads, unloads and load seconds too).

``POST /admin/drain`` (body optional: ``{"timeout": S}``, default
``--drain-timeout``) begins a drain (:mod:`afm_http._drain`) and answers with
its status; ``DELETE /admin/drain`` ends one begun that way (a shutdown's
drain cannot be ended: 409).  Both need the API key when one is set.  The
middleware (``afm_http._middleware``, after its id and key checks) answers
new generation requests 503 while the replica drains.
"""

from __future__ import annotations

import math

from quart import Response, request

from afm_core import EngineStatistics, RequestError, runtime_info

from .. import _metrics
from .._asgi import AFMQuart
from .._errors import error_response
from .._json import json_response
from .._request import read_json
from .._state import AppState, current_state

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    app.post("/admin/drain")(drain_start)
    app.delete("/admin/drain")(drain_stop)


async def health() -> Response:
    state = current_state()
    served = [e.statistics() for e in state.models.engines()]
    failure = next((e.failure for e in state.engines if e.failure is not None), None)
    ok = failure is None
    drain = state.draining.status()
    info = runtime_info()
    status = "unavailable" if not ok else "draining" if drain is not None else "ok"
    several: dict[str, object] = {"models": {row.id: row.state for row, _ in state.models.rows()}} \
        if state.models.strict else {}
    config = state.models.config
    if config.kv_bits is not None:  # a quantized KV cache (--kv-bits); absent: float
        several["kv_cache"] = {"bits": config.kv_bits, "group_size": config.kv_group_size}
    totals = {name: sum(getattr(s, name) for s in served) for name in EngineStatistics.health_fields()}
    return json_response({"status": status, "model": state.models.default_id, **totals,
                          "inflight": len(state.inflight),
                          "draining": None if drain is None else drain.to_dict(),
                          "error": failure,
                          "blas": info.blas, "quantized_kernel": info.quantized_kernel,
                          "compiled": info.compiled, **several},
                         status=200 if status == "ok" else 503)


async def metrics() -> Response:
    state = current_state()
    rows = list(state.models.rows())
    engines = [(e.statistics(), row.id) for row, e in rows if e is not None]
    if state.embedder is not None:
        engines.append((state.embedder.statistics(), state.embedder.model_id))
    models = [row for row, _ in rows]
    text = _metrics.render(engines, dict(state.statuses), draining=state.draining.active,
                           inflight=len(state.inflight), models=models,
                           max_loaded_bytes=state.models.table.max_bytes)
    return Response(text, content_type=_metrics.CONTENT_TYPE)


def _drain_body(state: AppState) -> dict[str, object]:
    drain = state.draining.status()
    return {"draining": drain is not None, "inflight": len(state.inflight),
            **({} if drain is None else drain.to_dict())}


async def drain_start() -> Response:
    state = current_state()
    timeout = state.config.drain_timeout
    if request.content_length or request.headers.get("Transfer-Encoding"):
        body = await read_json()
        if not isinstance(body, dict) or set(body) - {"timeout"}:
            raise RequestError("the body must be {} or {\"timeout\": seconds}", param="timeout")
        value = body.get("timeout", timeout)
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not 0 <= value < math.inf:
            raise RequestError("timeout must be a number of seconds >= 0", param="timeout")
        timeout = float(value)
    state.draining.start(timeout, "admin")
    return json_response(_drain_body(state), 202)


async def drain_stop() -> Response:
    state = current_state()
    if state.draining.shutting_down:
        return error_response(409, "this server is shutting down: its drain cannot be ended",
                              code="shutting_down")
    state.draining.resume()
    return json_response(_drain_body(state))
