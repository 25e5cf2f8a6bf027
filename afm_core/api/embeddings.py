"""OpenAI's Embeddings API (``POST /v1/embeddings``), as a sans-IO translation.

:func:`parse` validates a body into an :class:`EmbeddingsCall` (its inputs
as the engine takes them); :func:`response` turns the engine's vectors into
the response object::

    call = embeddings.parse(body)                       # raises RequestError
    result = await engine.embed(call.inputs)            # afm_core.Embeddings
    obj = embeddings.response(call, result.vectors, model=call.model or engine.model_id,
                              prompt_tokens=result.prompt_tokens)

The body:

* ``input`` (required): a string, a list of strings, a list of token ids, or
  a list of token-id lists (OpenAI's four forms); no input may be empty,
  and at most :data:`MAX_INPUTS` inputs are taken;
* ``encoding_format``: ``float`` (the default: lists of numbers) or
  ``base64`` (each vector's little-endian float32 bytes, base64-encoded, as
  OpenAI sends them and its SDK decodes them);
* ``dimensions``: the vectors' length.  The model's hidden size is the
  natural length; a smaller one truncates each vector and L2-normalizes it
  again (Matryoshka-style: meaningful for models trained for it, a plain
  truncation otherwise); a larger one is a 400 naming the hidden size;
* ``model`` is accepted (any string) and echoed back; ``user`` is ignored.

The response: ``{"object": "list", "data": [{"object": "embedding",
"index": i, "embedding": [...] or "base64..."}], "model": ...,
"usage": {"prompt_tokens": N, "total_tokens": N}}``.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard
library.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._validate import err, integer, json_object, optional_str, valid_text

__all__ = ["ENCODING_FORMATS", "MAX_INPUTS", "EmbeddingsCall", "encode_vector", "parse", "resize", "response"]

MAX_INPUTS = 2048
"""Inputs one request may carry (OpenAI's limit)."""

ENCODING_FORMATS = ("float", "base64")

_INPUT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"


@dataclass(frozen=True, slots=True)
class EmbeddingsCall:
    """A validated embeddings body."""

    inputs: tuple[str | tuple[int, ...], ...]
    """One text or token-id tuple per vector to return, in order."""
    encoding_format: str = "float"
    dimensions: int | None = None
    model: str | None = None


def _token_ids(v: list[Any], param: str) -> tuple[int, ...]:
    if not v:
        raise err("an input must not be empty", param)
    for i in v:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise err(f"token ids must be non-negative integers, not {i!r}", param)
    return tuple(v)


def _inputs(body: dict[str, Any]) -> tuple[str | tuple[int, ...], ...]:
    v = body.get("input")
    if v is None:
        raise err("'input' is required", "input")
    if isinstance(v, str):
        if not v:
            raise err("'input' must not be an empty string", "input")
        return (valid_text(v, "input"),)
    if not isinstance(v, list):
        raise err(f"'input' must be {_INPUT_FORMS}", "input")
    if not v:
        raise err("'input' must not be an empty list", "input")
    if all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        return (_token_ids(v, "input"),)
    if len(v) > MAX_INPUTS:
        raise err(f"'input' may hold at most {MAX_INPUTS} inputs", "input")
    items: list[str | tuple[int, ...]] = []
    for n, item in enumerate(v):
        param = f"input[{n}]"
        if isinstance(item, str):
            if not item:
                raise err("an input must not be an empty string", param)
            items.append(valid_text(item, param))
        elif isinstance(item, list):
            items.append(_token_ids(item, param))
        else:
            raise err(f"'input' must be {_INPUT_FORMS}", param)
    return tuple(items)


def parse(body: Any) -> EmbeddingsCall:
    """Validate an embeddings body (see the module docstring); raises :class:`RequestError`."""
    body = json_object(body)
    inputs = _inputs(body)
    fmt = optional_str(body, "encoding_format")
    if fmt is None:
        fmt = "float"
    elif fmt not in ENCODING_FORMATS:
        raise err("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dimensions = integer(body, "dimensions", 1, 1 << 20, None)
    model = optional_str(body, "model")
    optional_str(body, "user")
    return EmbeddingsCall(inputs, fmt, dimensions, model)


def resize(vector: Sequence[float], dimensions: int | None) -> list[float]:
    """``vector`` at ``dimensions`` (see the module docstring): unchanged when
    None or its own length, truncated and L2-normalized again when shorter;
    a 400 when longer than the vector (the model's hidden size)."""
    if dimensions is None or dimensions == len(vector):
        return list(vector)
    if dimensions > len(vector):
        raise err(f"'dimensions' must be at most the model's hidden size ({len(vector)}); "
                  f"got {dimensions}", "dimensions")
    head = list(vector[:dimensions])
    norm = math.sqrt(math.fsum(x * x for x in head))
    return [x / norm for x in head] if norm > 0 else head


def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """``vector`` as the response carries it: a list of floats, or for
    ``base64`` its little-endian float32 bytes base64-encoded."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return [float(x) for x in vector]


def response(call: EmbeddingsCall, vectors: Sequence[Sequence[float]], *, model: str,
             prompt_tokens: int) -> dict[str, Any]:
    """The ``list`` object answering ``call`` with ``vectors`` (one per input, in order)."""
    data = [
        {"object": "embedding", "index": i,
         "embedding": encode_vector(resize(v, call.dimensions), call.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
