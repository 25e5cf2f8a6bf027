"""``/v1/responses``: OpenAI Responses, streamed or not, stored, continued, cancelled.

``POST /v1/responses/compact`` (:mod:`afm_core.api.responses_compact`) runs
a summarising turn of the served model, not streamed, and answers with the
``response.compaction`` object.

``POST /v1/responses`` validates the body with
:func:`afm_core.api.responses.parse` (``previous_response_id`` is looked up
in the app's :class:`~afm_core.api.responses_store.ResponseStore`) and runs
its chat request on the engine under the HTTP request id (the client's
``X-Request-ID`` or a minted one), so the chat cancel route
``POST /v1/chat/completions/{request_id}/cancel`` ends it too.  The
translation's :class:`~afm_core.api.responses.ResponseWriter` turns the
events into Responses events: one write per engine step (``event: TYPE`` /
``data: {...}`` frames, no ``[DONE]``; ``response.in_progress`` again while
the engine is silent, ``ServerConfig.keepalive_seconds``), or, without ``stream``, the final
Response object.  When a choice's finish arrives, its reasoning text is
re-tokenized for ``usage.output_tokens_details.reasoning_tokens``.

``n`` > 1 (afm's extension) runs each choice as its own engine stream, opened
as chat's are (:func:`~afm_http._streaming.open_model_choices`, on the
model the body's ``model`` names: choice 0 under the
request id, choice ``i`` as ``<id>/<i>`` in its group, the prompt prefilled
once), so every cancel below ends them all; the steps of every choice are
read together and written once per engine step, the writer interleaving their
items by ``output_index``.  At most ``max_batch + max_waiting`` choices (a
400 beyond).  Prompt progress (``X-AFM-Progress``) is choice 0's, and so is
the profile (``X-AFM-Profile``): an ``afm.profile`` event just before the
terminal event, and an ``afm_profile`` (or ``afm_profile_extended``) field of
the Response object from then on (the terminal event's, the non-streaming
answer, a stored response).

While it runs, a response is registered by its id (``resp_…``):
``POST /v1/responses/{id}/cancel`` cancels its engine request and answers
with the Response once it ended (status ``cancelled``); ``GET`` shows it
``in_progress`` (``store: true`` only).  Once it ended, a ``store: true``
response is kept in the store (bounded by ``ServerConfig.
responses_store_size`` / ``responses_store_ttl``), including one ended by a
client disconnect (status ``cancelled``, no usage): ``GET`` and
``/input_items`` read it, ``DELETE`` removes it, ``cancel`` returns it
unchanged.  An unknown id is a 404 in OpenAI's envelope (an unknown
``previous_response_id`` too: ``previous_response_not_found``); a
``previous_response_id`` that is still running is a 400
(``previous_response_in_progress``), and so is ``DELETE`` while it runs.

Before headers are sent every failure is an HTTP status with the OpenAI
error envelope; after the stream began, a failure is ``response.failed``.
A non-streaming response that failed is a 500 (``generation_failed``), one
that was cancelled is returned with status ``cancelled``.
"""

from __future__ import annotations

from typing import Any

import trio
from quart import Response, request

from afm_core import AFMError, Engine, Finish, ReasoningDelta, RequestError, UnsupportedError
from afm_core.api import responses as api
from afm_core.api import responses_compact as compact_api
from afm_core.api.responses_store import StoredResponse

from .._asgi import AFMQuart
from .._drive import Before, check_room, respond
from .._json import json_response
from .._request import (
    model_choice,
    profile_requested,
    progress_requested,
    read_json,
    request_id,
    skipped_tools_header,
)
from .._state import AppState, LiveResponse, current_state
from .._streaming import Batch, open_model_choices

__all__ = ["register"]

CANCEL_WAIT_SECONDS = 10.0
"""How long ``cancel`` waits for the response to end (the engine ends it within
one step; only a client that stopped reading its stream can hold it longer)."""
MAX_ITEMS_PAGE = 100


def register(app: AFMQuart) -> None:
    app.post("/v1/responses")(responses_create)
    app.post("/v1/responses/input_tokens")(responses_input_tokens)
    app.post("/v1/responses/compact")(responses_compact)
    app.get("/v1/responses/<response_id>")(responses_retrieve)
    app.delete("/v1/responses/<response_id>")(responses_delete)
    app.post("/v1/responses/<response_id>/cancel")(responses_cancel)
    app.get("/v1/responses/<response_id>/input_items")(responses_input_items)


async def responses_create() -> Response:
    state = current_state()
    raw = await read_json()
    call = api.parse(raw, previous=lambda rid: _previous(state, rid))
    check_room(state, call.n, param="n")
    profile = profile_requested()
    progress = call.stream and progress_requested()
    rid = request_id()
    # closed when the request ends, even if no body runs
    stack, engine, streams = await open_model_choices(state, model_choice(raw), call.chat.per_choice(),
                                                      rid, profile=profile, progress=progress)
    first = streams[0]
    writer = api.Writer(api.ResponseWriter(call, id=api.new_id("resp"), created_at=first.created,
                                           model=first.model, profile=profile is not None))
    live = LiveResponse(rid, writer.state)
    state.responses_live[writer.state.id] = live
    stack.callback(_settle, state, live)  # runs before the engine streams are left
    downgraded = any(s.grammar_downgraded for s in streams)
    headers = {"X-Grammar-Constraints": "downgraded"} if downgraded else {}
    headers.update(skipped_tools_header(call.chat))
    return await respond(state, writer, streams, stack, stream=call.stream, request_id=rid,
                         headers=headers, before=_reasoning_counter(engine, writer.state))


async def responses_compact() -> Response:
    """``POST /v1/responses/compact`` (the SDK's ``responses.compact``; Codex's remote
    compaction): the served model summarises the conversation, answered as a
    ``response.compaction`` object (the user messages, then one ``compaction``
    item).  Run as a non-streamed, unstored Responses call under the request id,
    so the chat cancel route ends it too."""
    state = current_state()
    raw = await read_json()
    call = compact_api.parse(raw, previous=lambda rid: _previous(state, rid))
    rid = request_id()
    stack, engine, streams = await open_model_choices(state, model_choice(raw),
                                                      call.responses.chat.per_choice(), rid)
    first = streams[0]
    inner = api.Writer(api.ResponseWriter(call.responses, id=api.new_id("resp"),
                                          created_at=first.created, model=first.model))
    writer = compact_api.CompactWriter(call, inner)
    return await respond(state, writer, streams, stack, stream=False, request_id=rid,
                         before=_reasoning_counter(engine, inner.state))


async def responses_input_tokens() -> Response:
    """``POST /v1/responses/input_tokens`` (the SDK's ``responses.input_tokens.count``):
    the prompt tokens a ``responses.create`` with this body would start from."""
    state = current_state()
    raw = await read_json()
    call = api.parse(raw, previous=lambda rid: _previous(state, rid))
    async with state.engine_for(model_choice(raw)) as engine:
        ids = await engine.tokenize_chat(call.chat)
    return json_response({"object": "response.input_tokens", "input_tokens": len(ids)})


def _previous(state: AppState, response_id: str) -> StoredResponse | None:
    """The stored response a ``previous_response_id`` names; a 400 while it still runs."""
    live = state.responses_live.get(response_id)
    if live is not None and live.writer.call.store:
        raise RequestError(f"Previous response '{response_id}' is still in progress: wait for it "
                           "to finish (or cancel it) first.", param="previous_response_id",
                           code="previous_response_in_progress")
    return state.responses.get(response_id)


def _settle(state: AppState, live: LiveResponse) -> None:
    """The response ended (or its client left): final status, store, unregister."""
    writer = live.writer
    writer.abort()  # nothing if it already ended
    state.responses_live.pop(writer.id, None)
    if writer.call.store:
        state.responses.put(writer.stored())
    live.done.set()


def _reasoning_counter(engine: Engine, writer: api.ResponseWriter) -> Before:
    """Before a choice's finish reaches the writer: its reasoning text re-tokenized
    for ``usage.output_tokens_details.reasoning_tokens``."""

    async def before(choice: int, batch: Batch) -> None:
        if batch is None or writer.ended(choice):
            return
        cut = next((i for i, e in enumerate(batch) if type(e) is Finish), None)
        if cut is None:
            return
        text = writer.reasoning_text(choice) + "".join(
            e.text for e in batch[:cut] if type(e) is ReasoningDelta)
        if text:
            writer.set_reasoning_tokens(await _count_tokens(engine, text), choice)

    return before


async def _count_tokens(engine: Engine, text: str) -> int | None:
    try:
        return len(await engine.tokenize(text, parse_special=False))
    except AFMError:  # the engine is closing: report none rather than fail the response
        return None


def _not_found(response_id: str) -> RequestError:
    return RequestError(f"Response with id '{response_id}' not found.", param="response_id",
                        status=404, code="not_found")


def _visible(state: AppState, response_id: str) -> dict[str, Any]:
    """The Response object: a running ``store: true`` one, else a stored one; else 404."""
    live = state.responses_live.get(response_id)
    if live is not None and live.writer.call.store:
        return live.writer.response
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.response


async def responses_retrieve(response_id: str) -> Response:
    if request.args.get("stream", "false").lower() not in ("false", "0", ""):
        raise UnsupportedError("streaming a response again (GET with stream=true) is not supported",
                               param="stream")
    return json_response(_visible(current_state(), response_id))


async def responses_delete(response_id: str) -> Response:
    state = current_state()
    live = state.responses_live.get(response_id)
    if live is not None and live.writer.call.store:
        raise RequestError(f"Response '{response_id}' is in progress: cancel it first, then delete it.",
                           param="response_id", code="response_in_progress")
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


async def responses_cancel(response_id: str) -> Response:
    state = current_state()
    live = state.responses_live.get(response_id)
    if live is None:
        stored = state.responses.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return json_response(stored.response)  # it already ended: unchanged
    state.cancel(live.request_id)
    with trio.move_on_after(CANCEL_WAIT_SECONDS):
        await live.done.wait()
    return json_response(live.writer.response)


def _page_args() -> tuple[int, str, str | None]:
    raw = request.args.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_ITEMS_PAGE:
        raise RequestError(f"'limit' must be an integer between 1 and {MAX_ITEMS_PAGE}",
                           param="limit")
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError("'order' must be asc or desc", param="order")
    return limit, order, request.args.get("after")


async def responses_input_items(response_id: str) -> Response:
    """The items a response was generated from (earlier responses' too), a page at a time."""
    state = current_state()
    limit, order, after = _page_args()
    live = state.responses_live.get(response_id)
    if live is not None and live.writer.call.store:
        items = list(live.writer.call.conversation)
    else:
        stored = state.responses.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        items = list(stored.input_items)
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise RequestError(f"no input item with id '{after}' in this response", param="after")
        start = ids.index(after) + 1
    page = items[start:start + limit]
    return json_response({
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    })
