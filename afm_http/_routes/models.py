"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model served."""

from __future__ import annotations

import time
from typing import Any

from quart import Response

from afm_core import Engine

from .._asgi import AFMQuart
from .._errors import error_response
from .._json import json_response
from .._state import current_state

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.get("/v1/models")(models)
    app.get("/v1/models/<path:model_id>")(model)


def model_card(engine: Engine) -> dict[str, Any]:
    return {
        "id": engine.model_id,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "afm",
        "context_length": engine.context_length,
        "max_model_len": engine.context_length,
    }


async def models() -> Response:
    return json_response({"object": "list",
                          "data": [model_card(e) for e in current_state().engines]})


async def model(model_id: str) -> Response:
    for engine in current_state().engines:
        if model_id == engine.model_id:
            return json_response(model_card(engine))
    return error_response(404, "no such model", param="model", code="model_not_found")
