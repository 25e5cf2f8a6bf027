"""``POST /v1/chat/completions/{id}/cancel``: end an open request by its id.

The stream ends with ``finish_reason: "cancelled"`` (then ``[DONE]``); the
answer is 200 if a request was cancelled, 404 otherwise.
"""

from __future__ import annotations

from quart import Response

from .._asgi import AFMQuart
from .._ids import valid_request_id
from .._json import json_response
from .._state import current_state

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.post("/v1/chat/completions/<path:target>/cancel")(cancel)


async def cancel(target: str) -> Response:
    cancelled = valid_request_id(target) and current_state().cancel(target)
    body = {"id": target, "object": "chat.completion.cancellation", "cancelled": bool(cancelled)}
    return json_response(body, 200 if cancelled else 404)
