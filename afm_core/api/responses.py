"""OpenAI Responses (``POST /v1/responses``), as a sans-IO translation.

:func:`parse` validates a Responses body into a :class:`ResponsesCall`: the
engine's :class:`~afm_core.ChatRequest` (built as an OpenAI chat body and
validated by ``ChatRequest.from_openai``) plus what the Response object
echoes.  :class:`ResponseWriter` turns the engine's events into the
Responses streaming events and the final Response object::

    call = responses.parse(body, previous=store.get)     # raises RequestError
    # one engine stream per choice: call.chat.per_choice() (call.n of them)
    writer = responses.ResponseWriter(call, id=responses.new_id("resp"),
                                      created_at=stream.created, model=stream.model,
                                      profile=profiled)          # X-AFM-Profile asked
    sse = responses.encode(writer.start())
    for each engine step, for each choice i that had a batch:
        sse = responses.encode(writer.feed(batch, i))    # writer.close(i) at its stream's end
    sse = responses.encode(writer.end())
    store.put(writer.stored())                           # when call.store
    writer.response                                      # the Response object

:class:`Writer` wraps a :class:`ResponseWriter` in the one writer protocol
(:mod:`afm_core.api.writer`) the HTTP driver runs.

The request.  ``input`` is a string (one user message) or a list of items:
messages (roles ``user``, ``system``, ``developer``, ``assistant``; string
content or ``input_text`` / ``output_text`` / ``refusal`` parts),
``function_call``, ``function_call_output`` (string output or text parts;
its ``call_id`` must name a function call earlier in the conversation) and
``reasoning`` (its text goes back to the template as the assistant turn's
``reasoning_content``; ``encrypted_content`` is ignored) and ``compaction``
(one this server's ``/v1/responses/compact`` made,
:mod:`afm_core.api.responses_compact`: its summary is a user turn; another
server's is a 400).  A ``compaction_trigger`` as the last input item (Codex's
remote compaction; anywhere else a 400) makes the turn a summary: the
conversation, then :data:`~afm_core.api.responses_request.SUMMARY_PROMPT` as
a user message, no tools and no ``text.format``; its one output item is a
``compaction`` (``response.output_item.added``, a
``response.compaction.compacting`` event per summary delta,
``response.output_item.done``), reasoning and calls dropped.  Consecutive
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
A ``namespace`` tool's functions are offered as ``<namespace>__<name>``; a
call to one is a ``function_call`` item with the function's ``name`` and
its ``namespace`` (an input ``function_call`` with ``namespace`` is joined
again for the template).  Hosted tools (``web_search``, ``file_search``,
``custom``, ...: :mod:`afm_core.api._hosted`) are echoed but not offered
(``ChatRequest.skipped_tools``, the ``X-AFM-Skipped-Tools`` header); a
``tool_choice`` naming one is ``auto``.
``text.format`` ``json_object`` / ``json_schema`` (enforced by the engine's
grammar: strict, or best-effort without ``strict``) is the chat ``response_format``.  ``reasoning.effort``
goes to the chat template (``none`` turns thinking off; ``xhigh`` and
``max`` are sent as ``high``); ``reasoning.summary`` is echoed, the summary
is always the model's whole reasoning text.  ``include`` with
``message.output_text.logprobs`` (or ``top_logprobs`` > 0) adds logprobs to
the text.  ``truncation: "auto"`` is accepted but nothing is truncated (a
prompt past the context is still a 400).  ``background: true``, ``conversation``, ``prompt``
templates, ``context_management``, ``item_reference`` items and non-text
content (images, files, audio) are a 400 :class:`UnsupportedError`; unknown
fields are ignored.

``n`` (afm's extension, not an OpenAI Responses field: the ``openai`` SDK
sends it with ``extra_body={"n": 3}``) asks for 1 to ``MAX_N`` (16) choices,
validated as chat's ``n`` is.  The engine runs one stream per choice
(``call.chat.per_choice()``: they share the prompt's prefill); each choice
has its own output items, each tagged ``"choice_index": i`` (only when
``n`` > 1; the SDK's models keep the extra field).  ``output_index`` counts
the items of every choice in the order they are added, so a stream's items
interleave across choices; the Response object's ``output`` is in that
order when streamed (``output[e.output_index]`` is the event's item) and
grouped by choice (choice 0's items, then choice 1's ...) when not.  The
Response echoes ``"n"`` when it is above 1.  A stored response with
several choices cannot be continued: a ``previous_response_id`` naming one
is a 400 (``previous_response_has_choices``); send the chosen choice's items
as input instead.

The events, each with ``type`` and a ``sequence_number`` counting from 0:
``response.created`` and ``response.in_progress`` (status ``in_progress``;
``response.in_progress`` again, the Response as it is then, as the keepalive
while the engine is silent); per output item ``response.output_item.added``, its content events, then
``response.output_item.done``:

* reasoning (``rs_…``): ``response.reasoning_summary_part.added``,
  ``response.reasoning_summary_text.delta`` …, ``.done``,
  ``response.reasoning_summary_part.done``;
* a message (``msg_…``): ``response.content_part.added`` (``output_text``),
  ``response.output_text.delta`` …, ``.done``, ``response.content_part.done``;
* a function call (``fc_…``, ``call_id`` from the engine's tool-call
  tracker): ``response.function_call_arguments.delta`` as each fragment
  arrives, then ``.done``.

Reasoning and message items close when the next item of the same choice of
another kind begins; function calls (whose fragments may interleave) close at
their choice's finish, in output order.  Once every choice finished, the
stream ends with one of ``response.completed`` (every finish ``stop`` or
``tool_calls``), ``response.incomplete`` (a finish ``length``:
``incomplete_details.reason = "max_output_tokens"``; or cancelled: status
``cancelled``, ``incomplete_details`` null, since the SDK has no cancelled
event) or ``response.failed`` (a mid-stream failure of any choice: ``error.code
"server_error"``).  A choice's items close at its finish, ``incomplete``
unless it completed (the open items of every choice at a failure).  A choice
that completes without any output item gets an empty message, so
``output_text`` is ``""``.

A stream opened with ``progress=True`` (the ``X-AFM-Progress: true`` header)
also carries ``response.prompt_progress`` events (``prompt_progress``:
``total``, ``cache``, ``processed``, ``time_ms``) after ``response.in_progress``,
while the prompt is prefilled (with ``n`` > 1, the first choice's).

A stream opened with a profile (the ``X-AFM-Profile`` header: the engine's
one :class:`~afm_core.Profile` event, choice 0's, after its usage) is told so
with ``ResponseWriter(..., profile=True)``: the terminal event waits for the
profile, and just before it comes an ``afm.profile`` event (``{"type":
"afm.profile", "afm_profile": {...}, "sequence_number": n}``, or
``"afm_profile_extended"``: the same object as chat's ``afm_profile*``).
From then on the Response object carries it as a top-level ``afm_profile``
(or ``afm_profile_extended``) field: the terminal event's ``response``, the
non-streaming answer and a stored response.  The SDK passes the unknown
event type through, and its ``responses.stream`` helper skips it; the SDK's
``Response`` keeps the extra field.  No profile follows a failure.

Usage: ``input_tokens`` (``input_tokens_details.cached_tokens``: the prefix
cache's), counted once (the first choice's), ``output_tokens`` summed over the
choices, ``total_tokens``; ``output_tokens_details.reasoning_tokens`` sums what
the caller sets per choice with :meth:`ResponseWriter.set_reasoning_tokens`
before the choice's finish (afm's HTTP route re-tokenizes the reasoning text,
:meth:`ResponseWriter.reasoning_text`), else 0.

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

from .._errors import GenerationError
from .._stream.events import (
    ContentDelta,
    Event,
    Finish,
    LogprobsDelta,
    Profile,
    PromptProgress,
    ReasoningDelta,
    StreamFailure,
    ToolCallDelta,
    Usage,
)
from .._stream.sse import dumps
from .responses_items import Choice, Item, logprob_entry
from .responses_request import ResponsesCall, encode_summary, new_id, parse, to_messages
from .responses_store import StoredResponse

__all__ = [
    "ResponseWriter",
    "ResponsesCall",
    "Writer",
    "encode",
    "new_id",
    "parse",
    "to_messages",
]



class ResponseWriter:
    """Turn the engine's events (one stream per choice) into Responses events and the Response object.

    :meth:`start` gives ``response.created`` and ``response.in_progress``;
    :meth:`feed` the events for a choice's next engine events (one step or
    several).  A choice ends with the ``Usage`` after its ``Finish`` (or
    :meth:`close`: its stream ended; a finish without usage ends it, no
    finish fails the response); the terminal event comes once every choice
    ended, or from :meth:`end` (every stream ended), :meth:`fail` (an error
    outside the streams) or :meth:`abort` (the client left: status
    ``cancelled``, no event needed).  With ``profile`` (the stream was opened
    with one), the terminal event waits for the engine's ``Profile`` and
    follows an ``afm.profile`` event.  :attr:`response` is the Response
    object at any moment.
    """

    def __init__(self, call: ResponsesCall, *, id: str, created_at: float, model: str,
                 clock: Callable[[], float] = time.time,
                 ids: Callable[[str], str] = new_id, profile: bool = False) -> None:
        self.call = call
        self.id = id
        self.created_at = created_at
        self.model = model
        self._clock = clock
        self._ids = ids
        self._seq = 0
        self._started = False
        self._items: list[Item] = []
        self._choices = tuple(Choice(i) for i in range(call.n))
        self.status = "in_progress"
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        self.completed_at: float | None = None
        self.profile: Profile | None = None
        """The engine's profile (choice 0's), once it arrived."""
        self._expect_profile = profile  # the terminal event waits for it
        self._held = False  # every choice ended; the terminal event waits for the profile

    # -- state ---------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The response reached a terminal status (nothing more will be emitted)."""
        return self.status != "in_progress"

    def ended(self, choice: int = 0) -> bool:
        """Choice ``choice`` ended (its items are closed), or the whole response did."""
        return self.done or self._choices[choice].ended

    def reasoning_text(self, choice: int = 0) -> str:
        """Every reasoning item's text of choice ``choice`` so far."""
        return "".join(i.text for i in self._choices[choice].items if i.kind == "reasoning")

    def set_reasoning_tokens(self, tokens: int | None, choice: int = 0) -> None:
        """Choice ``choice``'s reasoning token count (``output_tokens_details.
        reasoning_tokens`` sums the choices'); set it before the choice's finish."""
        self._choices[choice].reasoning_tokens = tokens

    @property
    def response(self) -> dict[str, Any]:
        """The Response object now (``in_progress`` until the end).  Its output is
        in ``output_index`` order; with several choices, not streamed, grouped by
        choice (choice 0's items, then choice 1's ...)."""
        items = self._items
        if len(self._choices) > 1 and not self.call.stream:
            items = sorted(items, key=lambda item: item.choice)  # stable: each choice's in order
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": self.status, "background": False, "error": self.error,
            "incomplete_details": self.incomplete_details, "model": self.model,
            "output": [item.to_dict() for item in items],
        }
        out.update(self.call.settings)
        out["usage"] = self._usage_dict()
        out["completed_at"] = self.completed_at
        if self.profile is not None and self.status != "failed":
            out[self.profile.key] = self.profile.payload
        return out

    def stored(self) -> StoredResponse:
        """What ``store: true`` keeps once the response is done."""
        return StoredResponse(response=self.response, input_items=self.call.conversation)

    def _usage_dict(self) -> dict[str, Any] | None:
        """The prompt counted once (the first choice's with a usage), the output of every choice."""
        got = [(c.usage, c.reasoning_tokens) for c in self._choices if c.usage is not None]
        if not got:
            return None
        first = got[0][0]
        output = sum(u.completion_tokens for u, _ in got)
        return {
            "input_tokens": first.prompt_tokens,
            "input_tokens_details": {"cached_tokens": first.cached_tokens},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": sum(min(r or 0, u.completion_tokens)
                                                              for u, r in got)},
            "total_tokens": first.prompt_tokens + output,
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

    def keepalive(self) -> list[dict[str, Any]]:
        """The engine has been silent a while (a long prefill, a wait for a slot):
        ``response.in_progress`` again, with the Response as it is now.  Clients
        whose idle timers count events, not SSE comments (Codex), see it; every
        client that reads the Responses stream accepts it.  Nothing once done."""
        out = self.start()
        if not out and not self.done:
            self._event(out, "response.in_progress", response=self.response)
        return out

    def feed(self, events: Iterable[Event], choice: int = 0) -> list[dict[str, Any]]:
        """The Responses events for choice ``choice``'s next engine events."""
        out = self.start()
        ch = self._choices[choice]
        # a token's LogprobsDelta follows the events its text made: a text delta
        # (it joins it), reasoning or tool-call markup (dropped) or nothing yet
        # (held back: it joins the next text delta)
        last: dict[str, Any] | None = None
        prev: type | None = None
        for event in events:
            kind = type(event)
            if kind is Profile:  # after the usage (the choice has ended)
                out += self._profile(event)  # type: ignore[arg-type]
                continue
            if self.done or ch.ended:
                continue  # nothing else follows a choice's end, or the response's
            if self.call.compaction and kind in (ContentDelta, ReasoningDelta, ToolCallDelta):
                if kind is ContentDelta:
                    self._summary(ch, event.text, out)  # type: ignore[union-attr]
                continue  # the summary alone is the output (no reasoning, no calls)
            if kind is ContentDelta:
                last = self._content(ch, event.text, out) or last  # type: ignore[union-attr]
            elif kind is LogprobsDelta:
                if prev in (ContentDelta, LogprobsDelta, None):
                    self._logprobs(ch, event, last if prev is ContentDelta else None)  # type: ignore[arg-type]
            elif kind is ReasoningDelta:
                ch.lp_pending = []
                self._reason(ch, event.text, out)  # type: ignore[union-attr]
            elif kind is ToolCallDelta:
                ch.lp_pending = []
                self._tool(ch, event, out)  # type: ignore[arg-type]
            elif kind is Finish:
                ch.finish = event.reason  # type: ignore[union-attr]
            elif kind is Usage:
                ch.usage = event  # type: ignore[assignment]
                if ch.finish is not None:
                    out += self._end_choice(ch)
            elif kind is StreamFailure:
                out += self.fail(event.message, type=event.type)  # type: ignore[union-attr]
            elif kind is PromptProgress:
                self._event(out, "response.prompt_progress", prompt_progress=event.to_dict())  # type: ignore[union-attr]
                continue  # not a token: the logprobs pairing is unchanged
            prev = kind
        return out

    def close(self, choice: int = 0) -> list[dict[str, Any]]:
        """Choice ``choice``'s stream has no more events: end the choice (a
        finish without usage) or, without a finish, fail the response."""
        out = self.start()
        ch = self._choices[choice]
        if self.done:
            return out
        if ch.ended:
            return out + self._release()  # a profile that never came: the terminal event now
        if ch.finish is not None:
            return out + self._end_choice(ch)
        return out + self.fail("the stream ended before it finished")

    def end(self) -> list[dict[str, Any]]:
        """No stream has more events: finish the response if it is not done."""
        out = self.start()
        for i in range(len(self._choices)):
            out += self.close(i)
        return out

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

    def _profile(self, event: Profile) -> list[dict[str, Any]]:
        """Keep the profile (for the end); it releases a terminal event waiting for it."""
        if self.status == "failed" or self.profile is not None:
            return []
        self.profile = event
        return self._release()

    def _release(self) -> list[dict[str, Any]]:
        """The end, if it was waiting for the profile."""
        if not self._held:
            return []
        self._held = False
        return self._finale()

    def abort(self) -> None:
        """The client left before the end: status ``cancelled``, nothing to send."""
        if not self.done:
            self._close_all("incomplete", [])
            self.status = "cancelled"

    # -- items ---------------------------------------------------------------------

    def _open(self, ch: Choice, kind: str, prefix: str, out: list[dict[str, Any]],
              **kw: Any) -> Item:
        item = Item(kind, self._ids(prefix), len(self._items), ch.index,
                    tagged=len(self._choices) > 1, **kw)
        self._items.append(item)
        ch.items.append(item)
        self._event(out, "response.output_item.added", output_index=item.index,
                    item=item.to_dict())
        if kind == "reasoning":
            self._event(out, "response.reasoning_summary_part.added", item_id=item.id,
                        output_index=item.index, summary_index=0, part=item.part())
        elif kind == "message":
            self._event(out, "response.content_part.added", item_id=item.id,
                        output_index=item.index, content_index=0, part=item.part())
        return item

    def _close(self, item: Item, status: str, out: list[dict[str, Any]]) -> None:
        ch = self._choices[item.choice]
        ids = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            self._event(out, "response.reasoning_summary_text.done", **ids, summary_index=0,
                        text=item.text)
            self._event(out, "response.reasoning_summary_part.done", **ids, summary_index=0,
                        part=item.part())
            ch.reasoning = None
        elif item.kind == "message":
            if ch.lp_pending:
                item.logprobs += ch.lp_pending
                ch.lp_pending = []
            self._event(out, "response.output_text.done", **ids, content_index=0, text=item.text,
                        logprobs=list(item.logprobs))
            self._event(out, "response.content_part.done", **ids, content_index=0,
                        part=item.part())
            ch.message = None
        elif item.kind == "compaction":
            item.encrypted = encode_summary(item.text.strip())
            ch.message = None
        else:
            self._event(out, "response.function_call_arguments.done", **ids, arguments=item.text)
        item.status = status
        self._event(out, "response.output_item.done", output_index=item.index,
                    item=item.to_dict())

    def _close_all(self, status: str, out: list[dict[str, Any]],
                   items: Iterable[Item] | None = None) -> None:
        for item in self._items if items is None else items:
            if not item.done:
                self._close(item, status, out)

    def _content(self, ch: Choice, text: str, out: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not text:
            return None
        item = ch.message
        if item is None:
            if ch.reasoning is not None:
                self._close(ch.reasoning, "completed", out)
            item = ch.message = self._open(ch, "message", "msg", out)
        item.parts.append(text)
        logprobs, ch.lp_pending = ch.lp_pending, []
        item.logprobs += logprobs
        return self._event(out, "response.output_text.delta", item_id=item.id,
                           output_index=item.index, content_index=0, delta=text, logprobs=logprobs)

    def _summary(self, ch: Choice, text: str, out: list[dict[str, Any]]) -> None:
        """A compaction's summary text: kept for its item; ``response.compaction.compacting``."""
        if not text:
            return
        item = ch.message
        if item is None:
            item = ch.message = self._open(ch, "compaction", "cmp", out)
        item.parts.append(text)
        self._event(out, "response.compaction.compacting", item_id=item.id, output_index=item.index)

    def _logprobs(self, ch: Choice, event: LogprobsDelta, last: dict[str, Any] | None) -> None:
        if not self.call.logprobs:
            return
        entries = [logprob_entry(e) for e in event.content]
        if last is not None and ch.message is not None:
            last["logprobs"] = last["logprobs"] + entries
            ch.message.logprobs += entries
        else:  # a token whose text is still held back: it joins the next text delta
            ch.lp_pending += entries

    def _reason(self, ch: Choice, text: str, out: list[dict[str, Any]]) -> None:
        if not text:
            return
        item = ch.reasoning
        if item is None:
            if ch.message is not None:
                self._close(ch.message, "completed", out)
            item = ch.reasoning = self._open(ch, "reasoning", "rs", out)
        item.parts.append(text)
        self._event(out, "response.reasoning_summary_text.delta", item_id=item.id,
                    output_index=item.index, summary_index=0, delta=text)

    def _tool(self, ch: Choice, event: ToolCallDelta, out: list[dict[str, Any]]) -> None:
        item = ch.calls.get(event.index)
        if item is None:
            for other in (ch.reasoning, ch.message):
                if other is not None:
                    self._close(other, "completed", out)
            name, space = self.call.tool_name(event.name or "")
            item = self._open(ch, "function_call", "fc", out, call_id=event.id or self._ids("call"),
                              name=name, namespace=space)
            ch.calls[event.index] = item
        if event.arguments:
            item.parts.append(event.arguments)
            self._event(out, "response.function_call_arguments.delta", item_id=item.id,
                        output_index=item.index, delta=event.arguments)

    def _end_choice(self, ch: Choice) -> list[dict[str, Any]]:
        """Choice ``ch`` finished: its open items close; after the last choice, the terminal event."""
        out: list[dict[str, Any]] = []
        ch.ended = True
        if ch.finish in ("stop", "tool_calls"):
            if not ch.items:  # an empty answer is an empty message, as output_text ""
                self._open(ch, "compaction" if self.call.compaction else "message",
                           "cmp" if self.call.compaction else "msg", out)
            self._close_all("completed", out, ch.items)
        else:
            self._close_all("incomplete", out, ch.items)
        if all(c.ended for c in self._choices):
            if self._expect_profile and self.profile is None:
                self._held = True  # the profile comes after the usage: the terminal waits for it
            else:
                out += self._finale()
        return out

    def _finale(self) -> list[dict[str, Any]]:
        """Every choice ended: the ``afm.profile`` event (when there is a profile), then
        the terminal event."""
        out: list[dict[str, Any]] = []
        if self.profile is not None:
            self._event(out, "afm.profile", **{self.profile.key: self.profile.payload})
        return out + self._terminal()

    def _terminal(self) -> list[dict[str, Any]]:
        """Every choice ended: ``completed`` if each completed, else ``incomplete``
        (``cancelled`` if one was cancelled, else a ``max_output_tokens`` one)."""
        out: list[dict[str, Any]] = []
        reasons = {c.finish for c in self._choices}
        if reasons <= {"stop", "tool_calls"}:
            self.status = "completed"
            self.completed_at = self._clock()
            self._event(out, "response.completed", response=self.response)
            return out
        if "cancelled" in reasons:
            self.status = "cancelled"
        else:  # "length": max_output_tokens (or the context) ran out
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
        self._event(out, "response.incomplete", response=self.response)
        return out


def _frame(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + dumps(event) + b"\n\n"


def encode(events: Iterable[dict[str, Any]]) -> bytes:
    """SSE frames ``event: TYPE`` / ``data: {...}`` for Responses events."""
    if isinstance(events, list) and len(events) == 1:  # the common step: one event
        return _frame(events[0])
    return b"".join(_frame(e) for e in events)


class Writer:
    """One Responses response, every choice: the writer protocol
    (:class:`afm_core.api.writer.Writer`) over a :class:`ResponseWriter`.
    Streamed: ``event: TYPE`` frames (``response.created`` and
    ``response.in_progress`` first, a terminal event last); the non-streamed
    Response object is :meth:`result` (:class:`~afm_core.GenerationError` if
    the response failed)."""

    media_type = "text/event-stream"
    stop_requested = False

    def __init__(self, state: ResponseWriter) -> None:
        self.state = state
        self.streaming = state.call.stream

    @property
    def done(self) -> bool:
        return self.state.done

    def ended(self, choice: int) -> bool:
        return self.state.ended(choice)

    def _out(self, events: list[dict[str, Any]]) -> bytes:
        return encode(events) if self.streaming and events else b""

    def start(self) -> bytes:
        return self._out(self.state.start()) if self.streaming else b""

    def feed(self, choice: int, events: Iterable[Event]) -> bytes:
        out = self.state.feed(events, choice)
        return encode(out) if self.streaming and out else b""

    def close(self, choice: int) -> bytes:
        return self._out(self.state.close(choice))

    def keepalive(self) -> bytes:
        return self._out(self.state.keepalive()) if self.streaming else b""

    def fail(self, message: str) -> bytes:
        return self._out(self.state.fail(message))

    def end(self) -> bytes:
        return self._out(self.state.end())

    def result(self) -> dict[str, Any]:
        if self.state.status == "failed":
            error = self.state.error or {}
            raise GenerationError(str(error.get("message") or "generation failed"))
        return self.state.response
