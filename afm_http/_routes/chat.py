"""``POST /v1/chat/completions``: OpenAI Chat Completions, streamed or not.

The route turns JSON into a :class:`~afm_core.ChatRequest` and writes the SSE
encoder's bytes, one write per engine step (and the SSE comment
``: keepalive`` while the engine is silent: ``ServerConfig.keepalive_seconds``).  The
engine emits the events, the encoder frames them, the engine's ``collect()``
builds the non-streaming response; the route only joins the choices.

``n`` > 1 runs each choice as its own engine stream, all at once (the
engine prefills the shared prompt once): choice 0 under the
client's request id, choice ``i`` as ``<id>/<i>`` in its group, so
``POST /v1/chat/completions/{id}/cancel`` ends every choice with
``finish_reason: "cancelled"``; with a ``seed``, choice ``i`` samples with
``seed + i``.  Each choice has its own encoder (``index=i``): the chunks of
all choices interleave, one write per engine step, as OpenAI's do; the usage
(one chunk after every choice finished, when ``stream_options.include_usage``
asks; always in the non-streaming answer) counts the prompt once and the
completion tokens of every choice.  ``X-AFM-Profile`` profiles choice 0 only:
its one ``afm_profile`` object (its prefill and decode; the other choices
decode in the same batch) comes after the usage, before ``[DONE]``.
``stream_options.include_progress`` (or the ``X-AFM-Progress: true`` header)
adds prompt-progress chunks (``choices: []``, ``prompt_progress``) while
choice 0's prompt is prefilled.

Before headers are sent every failure is an HTTP status with the OpenAI
error envelope; after a stream began, a failure is the encoder's
error-marked chunk followed by ``data: [DONE]`` (a failing choice stops the
others, and no usage follows).  Leaving early (client disconnect) drops
every choice at the next engine step.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from typing import Any

import trio
from quart import Response

from afm_core import (
    AFMError,
    ChatRequest,
    ChatStream,
    Finish,
    Profile,
    RequestError,
    SSEEncoder,
    StreamFailure,
    Usage,
)

from .._asgi import AFMQuart
from .._json import json_response
from .._request import model_choice, profile_requested, progress_requested, read_json, request_id
from .._state import current_state
from .._streaming import (
    KEEPALIVE_FRAME,
    STREAM_HEADERS,
    Batch,
    Keepalive,
    aclose_shielded,
    next_batches,
    open_model_choices,
)

__all__ = ["register"]

log = logging.getLogger("afm.http")

INTERRUPTED = StreamFailure("the stream ended before it finished", code="stream_interrupted")
"""A choice whose stream the engine closed without a finish (shutdown)."""


def register(app: AFMQuart) -> None:
    app.post("/v1/chat/completions")(chat_completions)


async def chat_completions() -> Response:
    state = current_state()
    body = await read_json()
    chat = ChatRequest.from_openai(body)
    profile = profile_requested()
    progress = chat.stream and progress_requested(chat.include_progress)
    room = state.models.config.max_batch + state.models.config.max_waiting
    if chat.n > room:
        raise RequestError(f"this server runs at most {room} choices (n) per request", param="n")
    rid = request_id()
    stack, _, streams = await open_model_choices(state, model_choice(body), chat.per_choice(), rid,
                                                 profile=profile, progress=progress)
    downgraded = any(s.grammar_downgraded for s in streams)
    headers = {"X-Grammar-Constraints": "downgraded"} if downgraded else {}
    if not chat.stream:
        async with stack:
            result = await _collect(streams)
        return json_response(result, headers=headers)
    body = _sse_body(streams, stack, include_usage=chat.include_usage, request_id=rid,
                     keepalive=state.config.keepalive_seconds)
    return Response(body, status=200, content_type="text/event-stream",
                    headers={**headers, **STREAM_HEADERS})


# -- non-streaming -----------------------------------------------------------------


async def _collect(streams: Sequence[ChatStream]) -> dict[str, Any]:
    """The ``chat.completion``: each choice's stream collected (all at once), one
    choice each; the first failure stops the others and is the answer."""
    if len(streams) == 1:
        return await streams[0].collect()
    results: list[dict[str, Any]] = [{} for _ in streams]
    failed: list[AFMError] = []
    async with trio.open_nursery() as nursery:

        async def collect(i: int) -> None:
            try:
                results[i] = await streams[i].collect()
            except AFMError as exc:  # raised below, outside the nursery (no exception group)
                failed.append(exc)
                nursery.cancel_scope.cancel()

        for i in range(len(streams)):
            nursery.start_soon(collect, i)
    if failed:
        raise failed[0]
    return _merged(results)


def _merged(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One response from each choice's own (choice 0's id, model and profile)."""
    out = dict(results[0])
    out["choices"] = [{**r["choices"][0], "index": i} for i, r in enumerate(results)]
    usages = [r["usage"] for r in results if r.get("usage")]
    if usages:
        usage = dict(usages[0])  # the prompt counted once
        usage["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        out["usage"] = usage
    return out


# -- streaming ---------------------------------------------------------------------


class _Choices:
    """The frames of every choice, step by step: each choice's events through
    its own encoder, its usage and profile held back for the end."""

    def __init__(self, streams: Sequence[ChatStream], *, include_usage: bool) -> None:
        first = streams[0]
        self.encoders = [SSEEncoder(first.id, first.created, first.model, index=i)
                         for i in range(len(streams))]
        self.include_usage = include_usage
        self.live = set(range(len(streams)))
        self.failed = False
        self._usage: dict[int, Usage] = {}
        self._profiles: list[Profile] = []

    def step(self, got: Sequence[tuple[int, Batch]]) -> bytes:
        """The frames of one engine step (the batches of the choices that had one)."""
        out: list[bytes] = []
        for i, batch in sorted(got, key=lambda item: item[0]):
            encoder = self.encoders[i]
            if batch is None:  # the engine closed the stream without a finish (shutdown)
                out.append(encoder.encode(INTERRUPTED))
                self.failed = True
                break
            events = []
            for event in batch:
                kind = type(event)
                if kind is Usage:
                    self._usage[i] = event
                elif kind is Profile:
                    self._profiles.append(event)
                else:
                    events.append(event)
                    if kind is Finish or kind is StreamFailure:
                        self.live.discard(i)
                        self.failed = self.failed or kind is StreamFailure
            if events:
                out.append(encoder.encode_many(events))
            if self.failed:
                break  # nothing of any choice follows a failure
        if not self.live and not self.failed:
            out.append(self._tail())
        return b"".join(out)

    def _tail(self) -> bytes:
        """After the last finish: the usage of every choice (when asked), then the profile."""
        out = []
        if self.include_usage and self._usage:
            usages = [self._usage[i] for i in sorted(self._usage)]
            first = usages[0]  # the prompt counted once
            total = Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages),
                          first.cached_tokens)
            out.append(self.encoders[0].encode(total))
        out += [self.encoders[0].encode(p) for p in self._profiles]
        return b"".join(out)

    def fail(self, failure: StreamFailure) -> bytes:
        self.failed = True
        return self.encoders[0].encode(failure)


async def _sse_body(streams: Sequence[ChatStream], stack: AsyncExitStack, *, include_usage: bool,
                    request_id: str, keepalive: float) -> AsyncIterator[bytes]:
    """The SSE body: one write per engine step (a keepalive comment after
    ``keepalive`` silent seconds), then ``[DONE]``; leaves the streams at the end."""
    choices = _Choices(streams, include_usage=include_usage)
    try:
        try:
            while choices.live and not choices.failed:
                got = await next_batches(streams, choices.live, keepalive)
                if isinstance(got, Keepalive):
                    yield KEEPALIVE_FRAME
                    continue
                data = choices.step(got)
                if data:
                    yield data
        except Exception as exc:  # headers are sent: report in-band
            log.exception("stream %s failed", request_id)
            yield choices.fail(StreamFailure(f"stream failed: {exc}", code="internal_error"))
        yield choices.encoders[0].done()
    finally:
        await aclose_shielded(stack)
