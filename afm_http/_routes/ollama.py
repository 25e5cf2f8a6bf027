"""Ollama's generating routes: ``POST /api/chat``, ``/api/generate``, ``/api/embed``
and the legacy ``/api/embeddings``.

The translation is :mod:`afm_core.api.ollama` (Ollama's bodies into the
engine's requests, the events into NDJSON lines or the one response object);
the driver (:mod:`afm_http._drive`) writes one line per engine step (Ollama
sends nothing while it waits, so no keepalive).  ``stream`` defaults to true,
as Ollama's.  ``keep_alive`` sets how long the model stays loaded once idle
(:func:`~afm_http._request.model_choice`); a body with nothing to generate
(no ``messages``, no ``prompt``) loads the model and answers ``done_reason:
"load"``, or with ``keep_alive: 0`` lets it unload (``"unload"``).  Leaving
early (the client disconnected) drops the request at the next engine step;
``POST /v1/chat/completions/{request_id}/cancel`` ends it (``done_reason:
"stop"``).  Errors are Ollama's ``{"error": "..."}`` with the status (the
middleware's envelope for ``/api/``), and a line ``{"error": "..."}`` once
the stream began.  The model routes (``/api/tags`` ...) are in
:mod:`.ollama_models`.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

from quart import Response

from afm_core import Engine, RequestError
from afm_core.api import ollama
from afm_core.api.embeddings import resize

from .._asgi import AFMQuart
from .._drive import respond
from .._json import json_response
from .._registry import ModelChoice
from .._request import model_choice, profile_requested, read_json, request_id
from .._state import AppState, current_state
from .._streaming import aclose_shielded, held_engine

__all__ = ["register"]


def register(app: AFMQuart) -> None:
    app.post("/api/chat")(ollama_chat)
    app.post("/api/generate")(ollama_generate)
    app.post("/api/embed")(ollama_embed)
    app.post("/api/embeddings")(ollama_embeddings)


async def ollama_chat() -> Response:
    return await _generate(chat=True)


async def ollama_generate() -> Response:
    return await _generate(chat=False)


async def _generate(*, chat: bool) -> Response:
    started = time.monotonic_ns()
    state = current_state()
    body = await read_json()
    call = ollama.parse_chat(body) if chat else ollama.parse_generate(body)
    choice = model_choice(body)
    if call.request is None:
        return await _load_or_unload(state, call, choice, chat=chat)
    rid = request_id()
    stack, engine = await held_engine(state, choice, rid)
    loaded = time.monotonic_ns()
    try:
        stream = await stack.enter_async_context(engine.stream(call.request, request_id=rid,
                                                               profile=profile_requested()))
    except BaseException:
        await aclose_shielded(stack)
        raise
    writer = ollama.Writer(model=call.model, chat=chat, stream=call.stream, logprobs=call.logprobs,
                           started=started, loaded=loaded)
    headers = {"X-Grammar-Constraints": "downgraded"} if stream.grammar_downgraded else {}
    return await respond(state, writer, [stream], stack, stream=call.stream, request_id=rid,
                         headers=headers)


async def _load_or_unload(state: AppState, call: ollama.OllamaCall, choice: ModelChoice, *,
                          chat: bool) -> Response:
    """Nothing to generate: load the model (or, with ``keep_alive: 0``, let it unload)."""
    if choice.keep_alive == 0:
        model_id = state.models.resolve(choice.model)
        if state.models.engine_of(model_id) is not None:  # (one that is not loaded stays so)
            async with state.engine_for(choice):
                pass  # released with a keep-alive of 0: unloaded now (unless the server pins it)
        return json_response(ollama.loaded_response(call.model, chat=chat, reason="unload"))
    async with state.engine_for(choice):
        pass
    return json_response(ollama.loaded_response(call.model, chat=chat, reason="load"))


async def _fitted(engine: Engine, call: ollama.EmbedCall) -> list[str | list[int]]:
    """The inputs, each cut to the context (``truncate``, Ollama's default) or a 400."""
    context = engine.context_length
    out: list[str | list[int]] = []
    for text in call.inputs:
        if len(text.encode("utf-8", "surrogatepass")) + 2 <= context:
            out.append(text)  # (a token is at least one byte; 2: what the tokenizer may add)
            continue
        ids = await engine.tokenize(text, add_special_tokens=True)
        if len(ids) <= context:
            out.append(text)
        elif call.truncate:
            out.append(ids[:context])
        else:
            raise RequestError("the input length exceeds the context length", param="input")
    return out


async def _embed(state: AppState, call: ollama.EmbedCall, choice: ModelChoice,
                 started: int) -> tuple[list[list[float]], int, int]:
    """The vectors (``dimensions`` applied), the input tokens and the load time in ns."""
    async with AsyncExitStack() as stack:
        engine = state.embedder
        if engine is None:
            engine = await stack.enter_async_context(state.engine_for(choice))
        loaded = time.monotonic_ns()
        if not call.inputs:
            return [], 0, loaded - started
        result = await engine.embed(await _fitted(engine, call))
    d = call.dimensions
    vectors = [resize(v, d if d is not None and d < len(v) else None) for v in result.vectors]
    return vectors, result.prompt_tokens, loaded - started


async def ollama_embed() -> Response:
    started = time.monotonic_ns()
    state = current_state()
    body = await read_json()
    call = ollama.parse_embed(body)
    vectors, tokens, load_ns = await _embed(state, call, model_choice(body), started)
    return json_response(ollama.embed_response(call.model, vectors, prompt_tokens=tokens,
                                               total_ns=time.monotonic_ns() - started, load_ns=load_ns))


async def ollama_embeddings() -> Response:
    """The legacy ``/api/embeddings``: ``{"embedding": [...]}`` for one ``prompt``."""
    started = time.monotonic_ns()
    state = current_state()
    body = await read_json()
    call = ollama.parse_embeddings(body)
    vectors, _, _ = await _embed(state, call, model_choice(body), started)
    return json_response({"embedding": vectors[0] if vectors else []})
