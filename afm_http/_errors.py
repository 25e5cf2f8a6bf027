"""OpenAI-style error responses for every failure before headers are sent."""

from __future__ import annotations

import json
from typing import Any

from quart import Response

from afm_core._errors import AFMError, EngineBusyError


def envelope(message: str, *, type: str = "invalid_request_error", param: str | None = None,
             code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(envelope(message, type=type, param=param, code=code))
    return Response(body, status=status, content_type="application/json", headers=headers or {})


def from_exception(exc: AFMError) -> Response:
    headers = {}
    if isinstance(exc, EngineBusyError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    body = json.dumps(exc.to_dict())
    return Response(body, status=exc.status, content_type="application/json", headers=headers)
