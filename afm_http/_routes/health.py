"""``GET /health`` (liveness, load and compute back-ends; 503 if the
generation thread died) and ``GET /metrics`` (Prometheus text)."""

from __future__ import annotations

from quart import Response

from afm_core import runtime_info

from .. import _metrics
from .._asgi import AFMQuart
from .._json import json_response
from .._state import current_state

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.get("/health")(health)
    app.get("/metrics")(metrics)


async def health() -> Response:
    engine = current_state().engine
    stats = engine.statistics()
    ok = engine.healthy
    info = runtime_info()
    return json_response({"status": "ok" if ok else "unavailable", "model": engine.model_id,
                          "running": stats.running, "waiting": stats.waiting,
                          "blas": info.blas, "quantized_kernel": info.quantized_kernel,
                          "compiled": info.compiled},
                         status=200 if ok else 503)


async def metrics() -> Response:
    state = current_state()
    engine = state.engine
    text = _metrics.render(engine.statistics(), engine.model_id, dict(state.statuses))
    return Response(text, content_type=_metrics.CONTENT_TYPE)
