"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models served here.

Each served model's entry has OpenAI's fields, its context (once it has been
loaded) and its ``state``: ``loaded``, ``loading``, ``unloading`` or
``unloaded`` (``afm serve --model A --model B`` loads a model on first use;
:mod:`afm_http._registry`).  The ``--embedding-model``, when there is one,
comes last (always loaded).
"""

from __future__ import annotations

from typing import Any

from quart import Response

from afm_core import Engine

from .._asgi import AFMQuart
from .._errors import error_response
from .._json import json_response
from .._state import AppState, current_state

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.get("/v1/models")(models)
    app.get("/v1/models/<path:model_id>")(model)


def _embedder_card(state: AppState, engine: Engine) -> dict[str, Any]:
    return {"id": engine.model_id, "object": "model", "created": state.models.created,
            "owned_by": "afm", "context_length": engine.context_length,
            "max_model_len": engine.context_length, "state": "loaded"}


def _cards(state: AppState) -> list[dict[str, Any]]:
    cards = state.models.cards()
    if state.embedder is not None:
        cards.append(_embedder_card(state, state.embedder))
    return cards


async def models() -> Response:
    return json_response({"object": "list", "data": _cards(current_state())})


async def model(model_id: str) -> Response:
    for card in _cards(current_state()):
        if model_id == card["id"]:
            return json_response(card)
    return error_response(404, "no such model", param="model", code="model_not_found")
