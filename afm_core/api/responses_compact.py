"""``POST /v1/responses/compact`` (the SDK's ``responses.compact``), as a sans-IO translation.

OpenAI's compaction endpoint takes a conversation (``input``: a string or
Responses input items; ``instructions``; ``previous_response_id``) and
answers with a ``response.compaction`` object whose ``output`` is every user
message of the conversation followed by one ``compaction`` item; the client
(Codex's remote compaction) replaces its history with that output and goes
on, sending the compaction item back as input.  OpenAI's item carries an
opaque ``encrypted_content``; afm's is the summary the served model wrote,
under a version tag (:func:`encode_summary`; no secret: the client only
passes it back).

:func:`parse` validates the body into a :class:`CompactCall`: a Responses
call (:func:`afm_core.api.responses.parse`, so every input item and error is
the same as ``POST /v1/responses``'s, ``store`` off, no tools) whose input is
the conversation followed by one more user message, :data:`SUMMARY_PROMPT`,
asking the model for a hand-off summary.  The HTTP layer runs it like any
non-streamed Responses call; :class:`CompactWriter` wraps that response's
writer and turns the finished Response into the compacted one (the summary
is its ``output_text``, reasoning dropped; ``usage`` is the summarising
pass's)::

    call = responses_compact.parse(body, previous=store.get)   # raises RequestError
    writer = responses_compact.CompactWriter(call, responses.Writer(
        responses.ResponseWriter(call.responses, id=..., created_at=..., model=...)))
    ... drive it (not streamed) ...
    writer.result()                              # the response.compaction object

A summary the model cut off at its token limit (``max_output_tokens`` when
given, else the context), or cancelled (the chat cancel route, by the
request id), is returned as far as it got; a failure is the Responses
writer's (``GenerationError``, a 500).  A compaction item in the input (a
second compaction) is rendered as the earlier summary, so the new summary
covers it (:func:`afm_core.api.responses.to_messages`).  ``stream``,
``background``, ``conversation`` and ``context_management`` are refused
(400); other unknown fields (``prompt_cache_key``, ``service_tier``, ...) are
ignored.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard
library.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import UnsupportedError
from .._stream.events import Event
from ._validate import err, json_object
from .responses import Writer
from .responses_request import SUMMARY_PROMPT, ResponsesCall, decode_summary, encode_summary, new_id
from .responses_request import parse as parse_responses
from .responses_store import StoredResponse

__all__ = ["SUMMARY_PROMPT", "CompactCall", "CompactWriter", "decode_summary", "encode_summary",
           "parse"]

@dataclass(frozen=True, slots=True)
class CompactCall:
    """A validated compaction body."""

    responses: ResponsesCall
    """The summarising turn, as a non-streamed, unstored Responses call."""
    kept: tuple[dict[str, Any], ...]
    """The conversation's user messages, in order: the compacted output's head."""


def parse(body: Any, *, previous: Callable[[str], StoredResponse | None] | None = None) -> CompactCall:
    """Validate a ``/v1/responses/compact`` body (raises :class:`~afm_core.RequestError`)."""
    body = json_object(body)
    if body.get("stream"):
        raise UnsupportedError("compaction is not streamed: leave 'stream' out", param="stream")
    for key in ("background", "conversation", "context_management", "prompt"):
        if body.get(key):
            raise UnsupportedError(f"'{key}' is not supported by responses/compact", param=key)
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        raw_input = [{"type": "message", "role": "user", "content": raw_input}]
    elif raw_input is None and body.get("previous_response_id") is not None:
        raw_input = []
    elif raw_input == []:
        raise err("'input' must be a string or a non-empty array of input items", "input")
    # only these are carried over to the summarising turn (no tools, no text format)
    turn = {key: body[key] for key in ("model", "instructions", "previous_response_id",
                                       "reasoning", "max_output_tokens", "n") if key in body}
    if isinstance(raw_input, list):
        turn["input"] = [*raw_input, {"type": "message", "role": "user", "content": SUMMARY_PROMPT}]
    else:
        turn["input"] = raw_input  # not a list: parse_responses says what is wrong with it
    turn["store"] = False
    call = parse_responses(turn, previous=previous)
    if call.n > 1:
        raise UnsupportedError("a compaction has one summary: 'n' must be 1", param="n")
    conversation = call.conversation[:-1]  # without the summarising prompt
    kept = tuple(item for item in conversation
                 if item["type"] == "message" and item["role"] == "user")
    return CompactCall(responses=call, kept=kept)


def compacted(call: CompactCall, response: dict[str, Any]) -> dict[str, Any]:
    """The ``response.compaction`` object for the summarising turn's finished Response."""
    summary = "".join(part.get("text", "") for item in response.get("output") or ()
                      if item.get("type") == "message"
                      for part in item.get("content") or ()).strip()
    item = {"id": new_id("cmp"), "type": "compaction", "encrypted_content": encode_summary(summary)}
    usage = response.get("usage") or {
        "input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}
    return {
        "id": response.get("id") or new_id("resp"),
        "object": "response.compaction",
        "created_at": int(response.get("created_at") or time.time()),
        "output": [*call.kept, item],
        "usage": usage,
    }


class CompactWriter:
    """The writer protocol (:class:`afm_core.api.writer.Writer`) of a compaction:
    a non-streamed Responses writer whose result is the compacted object."""

    media_type = "application/json"
    stop_requested = False

    def __init__(self, call: CompactCall, inner: Writer) -> None:
        self.call = call
        self.inner = inner

    @property
    def done(self) -> bool:
        return self.inner.done

    def ended(self, choice: int) -> bool:
        return self.inner.ended(choice)

    def start(self) -> bytes:
        return self.inner.start()

    def feed(self, choice: int, events: Sequence[Event] | Iterable[Event]) -> bytes:
        return self.inner.feed(choice, events)

    def close(self, choice: int) -> bytes:
        return self.inner.close(choice)

    def keepalive(self) -> bytes:
        return b""

    def fail(self, message: str) -> bytes:
        return self.inner.fail(message)

    def end(self) -> bytes:
        return self.inner.end()

    def result(self) -> dict[str, Any]:
        return compacted(self.call, self.inner.result())
