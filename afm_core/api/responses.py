"""OpenAI Responses (``POST /v1/responses``), as a sans-IO translation.

:func:`parse` validates a Responses body into a :class:`ResponsesCall`: the
engine's :class:`~afm_core.ChatRequest` (built as an OpenAI chat body and
validated by ``ChatRequest.from_openai``) plus what the Response object
echoes.  :class:`ResponseWriter` turns the engine's events into the
Responses streaming events and the final Response object::

    call = responses.parse(body, previous=store.get)     # raises RequestError
    async with engine.stream(call.chat) as stream:
        writer = responses.ResponseWriter(call, id=responses.new_id("resp"),
                                          created_at=stream.created, model=stream.model)
        sse = responses.encode(writer.start())
        async for batch in stream.batches():
            sse = responses.encode(writer.feed(batch))
        sse = responses.encode(writer.end())
    store.put(writer.stored())                           # when call.store
    writer.response                                      # the Response object

The request.  ``input`` is a string (one user message) or a list of items:
messages (roles ``user``, ``system``, ``developer``, ``assistant``; string
content or ``input_text`` / ``output_text`` / ``refusal`` parts),
``function_call``, ``function_call_output`` (string output or text parts;
its ``call_id`` must name a function call earlier in the conversation) and
``reasoning`` (its text goes back to the template as the assistant turn's
``reasoning_content``; ``encrypted_content`` is ignored).  Consecutive
assistant-side items (reasoning, assistant messages, function calls) form one
assistant turn; a reasoning item that no assistant content or call follows is
dropped.  ``instructions`` is a first system message (not carried over by
``previous_response_id``, as OpenAI's).  ``previous_response_id`` replays
the stored response's input and output items before the new input, so the
prompt shares its prefix with the previous one (the engine's prefix cache);
an unknown id is OpenAI's 404 ``previous_response_not_found``.  Function
``tools`` use the flat shape (``strict: true`` asks for grammar-enforced
arguments; omitted or null means false here, where OpenAI's server defaults
to true); ``tool_choice`` is ``auto``, ``none``, ``required``, a named
function, or ``allowed_tools`` (the tools are narrowed to that list).
``text.format`` ``json_object`` / ``json_schema`` (``strict`` enforced by
the engine's grammar) is the chat ``response_format``.  ``reasoning.effort``
goes to the chat template (``none`` turns thinking off; ``xhigh`` and
``max`` are sent as ``high``); ``reasoning.summary`` is echoed, the summary
is always the model's whole reasoning text.  ``include`` with
``message.output_text.logprobs`` (or ``top_logprobs`` > 0) adds logprobs to
the text.  ``truncation: "auto"`` is accepted but nothing is truncated (a
prompt past the context is still a 400).  Hosted tools (``web_search``,
``file_search``, ...), ``background: true``, ``conversation``, ``prompt``
templates, ``context_management``, ``item_reference`` items, non-text
content (images, files, audio) and ``n`` other than 1 (not a Responses
field: a response is one assistant turn, with one status and one usage, that
``previous_response_id`` continues) are a 400 :class:`UnsupportedError`;
unknown fields are ignored.

The events, each with ``type`` and a ``sequence_number`` counting from 0:
``response.created`` and ``response.in_progress`` (status ``in_progress``);
per output item ``response.output_item.added``, its content events, then
``response.output_item.done``:

* reasoning (``rs_…``): ``response.reasoning_summary_part.added``,
  ``response.reasoning_summary_text.delta`` …, ``.done``,
  ``response.reasoning_summary_part.done``;
* a message (``msg_…``): ``response.content_part.added`` (``output_text``),
  ``response.output_text.delta`` …, ``.done``, ``response.content_part.done``;
* a function call (``fc_…``, ``call_id`` from the engine's tool-call
  tracker): ``response.function_call_arguments.delta`` as each fragment
  arrives, then ``.done``.

Reasoning and message items close when the next item of another kind begins;
function calls (whose fragments may interleave) close at the end, in output
order.  The stream ends with one of ``response.completed`` (finish ``stop`` or
``tool_calls``), ``response.incomplete`` (finish ``length``:
``incomplete_details.reason = "max_output_tokens"``; or cancelled: status
``cancelled``, ``incomplete_details`` null, since the SDK has no cancelled
event) or ``response.failed`` (a mid-stream failure: ``error.code
"server_error"``).  Open items are closed first, ``incomplete`` unless the
response completed.  A response that completes without any output item gets
an empty message, so ``output_text`` is ``""``.

A stream opened with ``progress=True`` (the ``X-AFM-Progress: true`` header)
also carries ``response.prompt_progress`` events (``prompt_progress``:
``total``, ``cache``, ``processed``, ``time_ms``) after ``response.in_progress``,
while the prompt is prefilled.

Usage: ``input_tokens`` (``input_tokens_details.cached_tokens``: the prefix
cache's), ``output_tokens``, ``total_tokens``; ``output_tokens_details.
reasoning_tokens`` is whatever the caller sets in :attr:`ResponseWriter.
reasoning_tokens` before the finish (afm's HTTP route re-tokenizes the
reasoning text), else 0.

The request half (:func:`parse`, :class:`ResponsesCall`, :func:`to_messages`)
lives in :mod:`afm_core.api.responses_request`, the store in
:mod:`afm_core.api.responses_store`; this module is their public face.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard
library.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from .._stream.events import (
    ContentDelta,
    Event,
    Finish,
    LogprobsDelta,
    PromptProgress,
    ReasoningDelta,
    StreamFailure,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    clamp_logprob,
)
from .._stream.sse import dumps
from .responses_request import ResponsesCall, new_id, parse, to_messages
from .responses_store import StoredResponse

__all__ = [
    "ResponseWriter",
    "ResponsesCall",
    "encode",
    "new_id",
    "parse",
    "to_messages",
]



# -- events ------------------------------------------------------------------------


def _logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "token": entry.token,
        "bytes": list(entry.bytes) if entry.bytes is not None else [],
        "logprob": clamp_logprob(entry.logprob),
        "top_logprobs": [{"token": t.token, "bytes": list(t.bytes) if t.bytes is not None else [],
                          "logprob": clamp_logprob(t.logprob)} for t in entry.top_logprobs],
    }


class _Item:
    """One output item while it streams."""

    __slots__ = ("call_id", "id", "index", "kind", "logprobs", "name", "parts", "status")

    def __init__(self, kind: str, id: str, index: int, *, call_id: str = "", name: str = "") -> None:
        self.kind = kind
        self.id = id
        self.index = index
        self.call_id = call_id
        self.name = name
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.status = "in_progress"

    @property
    def done(self) -> bool:
        return self.status != "in_progress"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "summary_text", "text": self.text}
        return {"type": "output_text", "text": self.text, "annotations": [],
                "logprobs": list(self.logprobs)}

    def to_dict(self) -> dict[str, Any]:
        status = self.status
        if self.kind == "reasoning":
            summary = [self.part()] if self.parts or self.done else []
            return {"id": self.id, "type": "reasoning", "summary": summary, "status": status}
        if self.kind == "message":
            content = [self.part()] if self.parts or self.done else []
            return {"id": self.id, "type": "message", "status": status, "role": "assistant",
                    "content": content}
        return {"id": self.id, "type": "function_call", "status": status, "arguments": self.text,
                "call_id": self.call_id, "name": self.name}


class ResponseWriter:
    """Turn one engine stream's events into Responses events and the Response object.

    :meth:`start` gives ``response.created`` and ``response.in_progress``;
    :meth:`feed` the events for the engine's next events (one step or
    several); the terminal event comes with the ``Usage`` after the
    ``Finish``, or from :meth:`end` (the stream ended: a finish without usage
    completes, no finish fails), :meth:`fail` (an error outside the stream)
    or :meth:`abort` (the client left: status ``cancelled``, no event needed).
    :attr:`response` is the Response object at any moment.
    """

    def __init__(self, call: ResponsesCall, *, id: str, created_at: float, model: str,
                 clock: Callable[[], float] = time.time,
                 ids: Callable[[str], str] = new_id) -> None:
        self.call = call
        self.id = id
        self.created_at = created_at
        self.model = model
        self._clock = clock
        self._ids = ids
        self._seq = 0
        self._started = False
        self._items: list[_Item] = []
        self._reasoning: _Item | None = None
        self._message: _Item | None = None
        self._calls: dict[int, _Item] = {}
        self._finish: str | None = None
        self._usage: Usage | None = None
        self._lp_pending: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        self.completed_at: float | None = None
        self.reasoning_tokens: int | None = None
        """Set before the finish to report ``output_tokens_details.reasoning_tokens``."""

    # -- state ---------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The response reached a terminal status (nothing more will be emitted)."""
        return self.status != "in_progress"

    @property
    def reasoning_text(self) -> str:
        """Every reasoning item's text so far."""
        return "".join(i.text for i in self._items if i.kind == "reasoning")

    @property
    def response(self) -> dict[str, Any]:
        """The Response object now (``in_progress`` until the end)."""
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "background": False, "error": self.error,
            "incomplete_details": self.incomplete_details, "model": self.model,
            "output": [item.to_dict() for item in self._items],
        }
        out.update(self.call.settings)
        out["usage"] = self._usage_dict()
        out["completed_at"] = self.completed_at
        return out

    def stored(self) -> StoredResponse:
        """What ``store: true`` keeps once the response is done."""
        return StoredResponse(response=self.response, input_items=self.call.conversation)

    def _usage_dict(self) -> dict[str, Any] | None:
        u = self._usage
        if u is None:
            return None
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(self.reasoning_tokens or 0,
                                                              u.completion_tokens)},
            "total_tokens": u.total_tokens,
        }

    def _event(self, out: list[dict[str, Any]], type: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type, **fields, "sequence_number": self._seq}
        self._seq += 1
        out.append(event)
        return event

    # -- the stream ----------------------------------------------------------------

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress`` (once)."""
        out: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            self._event(out, "response.created", response=self.response)
            self._event(out, "response.in_progress", response=self.response)
        return out

    def feed(self, events: Iterable[Event]) -> list[dict[str, Any]]:
        """The Responses events for the engine's next events."""
        out = self.start()
        if self.done:
            return out
        # a token's LogprobsDelta follows the events its text made: a text delta
        # (it joins it), reasoning or tool-call markup (dropped) or nothing yet
        # (held back: it joins the next text delta)
        last: dict[str, Any] | None = None
        prev: type | None = None
        for event in events:
            kind = type(event)
            if kind is ContentDelta:
                last = self._content(event.text, out) or last  # type: ignore[union-attr]
            elif kind is LogprobsDelta:
                if prev in (ContentDelta, LogprobsDelta, None):
                    self._logprobs(event, last if prev is ContentDelta else None)  # type: ignore[arg-type]
            elif kind is ReasoningDelta:
                self._lp_pending = []
                self._reason(event.text, out)  # type: ignore[union-attr]
            elif kind is ToolCallDelta:
                self._lp_pending = []
                self._tool(event, out)  # type: ignore[arg-type]
            elif kind is Finish:
                self._finish = event.reason  # type: ignore[union-attr]
            elif kind is Usage:
                self._usage = event  # type: ignore[assignment]
                if self._finish is not None:
                    out += self._terminal(self._finish)
                    break
            elif kind is StreamFailure:
                out += self.fail(event.message, type=event.type)  # type: ignore[union-attr]
                break
            elif kind is PromptProgress:
                self._event(out, "response.prompt_progress", prompt_progress=event.to_dict())  # type: ignore[union-attr]
                continue  # not a token: the logprobs pairing is unchanged
            prev = kind
        return out

    def end(self) -> list[dict[str, Any]]:
        """The stream has no more events: finish it if it is not done."""
        out = self.start()
        if self.done:
            return out
        if self._finish is not None:
            return out + self._terminal(self._finish)
        return out + self.fail("the stream ended before it finished")

    def fail(self, message: str, *, type: str = "server_error") -> list[dict[str, Any]]:
        """End the response ``failed`` with ``message`` (``response.failed``)."""
        out = self.start()
        if self.done:
            return out
        self._close_all("incomplete", out)
        self.status = "failed"
        self.error = {"code": "server_error", "message": message, "type": type}
        self._event(out, "response.failed", response=self.response)
        return out

    def abort(self) -> None:
        """The client left before the end: status ``cancelled``, nothing to send."""
        if not self.done:
            self._close_all("incomplete", [])
            self.status = "cancelled"

    # -- items ---------------------------------------------------------------------

    def _open(self, kind: str, prefix: str, out: list[dict[str, Any]], **kw: str) -> _Item:
        item = _Item(kind, self._ids(prefix), len(self._items), **kw)
        self._items.append(item)
        self._event(out, "response.output_item.added", output_index=item.index,
                    item=item.to_dict())
        if kind == "reasoning":
            self._event(out, "response.reasoning_summary_part.added", item_id=item.id,
                        output_index=item.index, summary_index=0, part=item.part())
        elif kind == "message":
            self._event(out, "response.content_part.added", item_id=item.id,
                        output_index=item.index, content_index=0, part=item.part())
        return item

    def _close(self, item: _Item, status: str, out: list[dict[str, Any]]) -> None:
        ids = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            self._event(out, "response.reasoning_summary_text.done", **ids, summary_index=0,
                        text=item.text)
            self._event(out, "response.reasoning_summary_part.done", **ids, summary_index=0,
                        part=item.part())
            self._reasoning = None
        elif item.kind == "message":
            if self._lp_pending:
                item.logprobs += self._lp_pending
                self._lp_pending = []
            self._event(out, "response.output_text.done", **ids, content_index=0, text=item.text,
                        logprobs=list(item.logprobs))
            self._event(out, "response.content_part.done", **ids, content_index=0,
                        part=item.part())
            self._message = None
        else:
            self._event(out, "response.function_call_arguments.done", **ids, arguments=item.text)
        item.status = status
        self._event(out, "response.output_item.done", output_index=item.index,
                    item=item.to_dict())

    def _close_all(self, status: str, out: list[dict[str, Any]]) -> None:
        for item in self._items:
            if not item.done:
                self._close(item, status, out)

    def _content(self, text: str, out: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not text:
            return None
        item = self._message
        if item is None:
            if self._reasoning is not None:
                self._close(self._reasoning, "completed", out)
            item = self._message = self._open("message", "msg", out)
        item.parts.append(text)
        logprobs, self._lp_pending = self._lp_pending, []
        item.logprobs += logprobs
        return self._event(out, "response.output_text.delta", item_id=item.id,
                           output_index=item.index, content_index=0, delta=text, logprobs=logprobs)

    def _logprobs(self, event: LogprobsDelta, last: dict[str, Any] | None) -> None:
        if not self.call.logprobs:
            return
        entries = [_logprob(e) for e in event.content]
        if last is not None and self._message is not None:
            last["logprobs"] = last["logprobs"] + entries
            self._message.logprobs += entries
        else:  # a token whose text is still held back: it joins the next text delta
            self._lp_pending += entries

    def _reason(self, text: str, out: list[dict[str, Any]]) -> None:
        if not text:
            return
        item = self._reasoning
        if item is None:
            if self._message is not None:
                self._close(self._message, "completed", out)
            item = self._reasoning = self._open("reasoning", "rs", out)
        item.parts.append(text)
        self._event(out, "response.reasoning_summary_text.delta", item_id=item.id,
                    output_index=item.index, summary_index=0, delta=text)

    def _tool(self, event: ToolCallDelta, out: list[dict[str, Any]]) -> None:
        item = self._calls.get(event.index)
        if item is None:
            for other in (self._reasoning, self._message):
                if other is not None:
                    self._close(other, "completed", out)
            item = self._open("function_call", "fc", out, call_id=event.id or self._ids("call"),
                              name=event.name or "")
            self._calls[event.index] = item
        if event.arguments:
            item.parts.append(event.arguments)
            self._event(out, "response.function_call_arguments.delta", item_id=item.id,
                        output_index=item.index, delta=event.arguments)

    def _terminal(self, reason: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reason in ("stop", "tool_calls"):
            if not self._items:  # an empty answer is an empty message, as output_text ""
                self._open("message", "msg", out)
            self._close_all("completed", out)
            self.status = "completed"
            self.completed_at = self._clock()
            self._event(out, "response.completed", response=self.response)
            return out
        self._close_all("incomplete", out)
        if reason == "cancelled":
            self.status = "cancelled"
        else:  # "length": max_output_tokens (or the context) ran out
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
        self._event(out, "response.incomplete", response=self.response)
        return out


def encode(events: Iterable[dict[str, Any]]) -> bytes:
    """SSE frames ``event: TYPE`` / ``data: {...}`` for Responses events."""
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + dumps(e) + b"\n\n"
                    for e in events)
