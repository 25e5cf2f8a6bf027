"""``POST /v1/embeddings``: OpenAI's Embeddings API.

The body is validated by :mod:`afm_core.api.embeddings` (``input`` as a
string, strings, token ids or token-id lists; ``encoding_format`` ``float``
or ``base64``; ``dimensions``), the vectors come from
:meth:`afm_core.Engine.embed` (the served model's final hidden states,
pooled as ``--embedding-pooling`` / ``EngineConfig.embedding_pooling`` says,
L2-normalized; the model given by ``--embedding-model`` when there is one,
else the served model), and the response is OpenAI's ``list`` of ``embedding``
objects with ``usage``.  Bad input is a 400 in OpenAI's error envelope; a
model without a transformer body (the echo test model) is a 400 too.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

from quart import Response

from afm_core.api import embeddings as api

from .._asgi import AFMQuart
from .._json import json_response
from .._request import model_choice, read_json
from .._state import current_state

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.post("/v1/embeddings")(create_embeddings)


async def create_embeddings() -> Response:
    state = current_state()
    body = await read_json()
    call = api.parse(body)
    async with AsyncExitStack() as stack:
        engine = state.embedder
        if engine is None:
            engine = await stack.enter_async_context(state.engine_for(model_choice(body)))
        result = await engine.embed(call.inputs)
    return json_response(api.response(call, result.vectors, model=call.model or engine.model_id,
                                      prompt_tokens=result.prompt_tokens))
