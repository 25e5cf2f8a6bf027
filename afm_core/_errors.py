"""Every exception afm_core raises on purpose.

    AFMError
    ├── RequestError            invalid request; carries an HTTP status hint
    │   ├── ContextLengthError  prompt (+ max_tokens) exceeds the model context (400)
    │   ├── UnsupportedError    valid but not supported here (400 / 422)
    │   └── AdapterNotFoundError  a LoRA adapter the engine does not serve (404)
    ├── EngineBusyError         waiting queue full (503, Retry-After)
    ├── EngineClosedError       engine shut down / not running (503)
    │   └── DistributedError    a rank of a distributed model is gone or hung (503)
    ├── DuplicateRequestError   a request id already in flight (409)
    ├── ModelLoadError          a model could not be found, converted or loaded
    │   ├── GGUFError           a GGUF file is malformed or unsupported
    │   └── UnsupportedDecoderError  the tokenizer's decoder is unknown to the detokenizer
    ├── GenerationError         generation failed for one request after it began
    └── StreamProtocolError     a chunk stream violates the wire contract
        └── StreamErrorChunk    the stream carried an error-marked chunk

Request errors carry ``status``, ``type``, ``param`` and ``code`` so the HTTP
layer maps them to OpenAI's error envelope without the core importing HTTP.
"""

from __future__ import annotations

from typing import Any


class AFMError(Exception):
    """Base class of every afm error."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error envelope for this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class RequestError(AFMError):
    """The request is invalid; ``status`` is the HTTP status to answer with."""

    status = 400
    type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ):
        super().__init__(message, param=param, code=code)
        if status is not None:
            self.status = status


class ContextLengthError(RequestError):
    code = "context_length_exceeded"


class UnsupportedError(RequestError):
    code = "unsupported"


class AdapterNotFoundError(RequestError):
    """The request names a LoRA adapter the engine does not serve."""

    def __init__(self, message: str, *, param: str | None = "model") -> None:
        super().__init__(message, param=param, status=404, code="adapter_not_found")


class EngineBusyError(AFMError):
    status = 503
    type = "server_busy"
    code = "engine_busy"

    def __init__(self, message: str = "the engine's waiting queue is full", *, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineClosedError(AFMError):
    status = 503
    type = "server_error"
    code = "engine_closed"


class DistributedError(EngineClosedError):
    """The ranks serving one sharded model lost each other (a rank died, hung
    or went out of sync): the engine cannot generate until they restart."""

    code = "distributed_failed"


class DuplicateRequestError(AFMError):
    status = 409
    type = "invalid_request_error"
    code = "duplicate_request_id"


class ModelLoadError(AFMError):
    code = "model_load_failed"


class GGUFError(ModelLoadError):
    code = "gguf_unsupported"


class UnsupportedDecoderError(ModelLoadError):
    """The tokenizer's decoder is not one the incremental detokenizer knows."""

    code = "tokenizer_unsupported"


class GenerationError(AFMError):
    type = "server_error"
    code = "generation_failed"


class StreamProtocolError(AFMError):
    type = "stream_protocol_error"


class StreamErrorChunk(StreamProtocolError):
    """An error-marked chunk arrived; ``error`` holds its ``error`` object."""

    def __init__(self, error: dict[str, Any]):
        message = str(error.get("message") or "stream error")
        super().__init__(message, param=error.get("param"), code=error.get("code"))
        self.error = error
        etype = error.get("type")
        if isinstance(etype, str):
            self.type = etype
