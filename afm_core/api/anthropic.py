"""Anthropic Messages (``POST /v1/messages``) as a sans-IO translation.

Requests::

    request = parse_request(body)          # MessagesRequest; raises RequestError
    request.chat                           # the engine's ChatRequest
    count = parse_count_tokens(body)       # ChatRequest for /v1/messages/count_tokens

Responses, streamed or not, come from one state machine fed with the
engine's events::

    writer = MessageStream(model=request.model, input_tokens=stream.prompt_tokens,
                           stop_sequences=request.stop_sequences)
    out = writer.start()                   # message_start, ping
    for batch in engine batches:
        out = writer.feed_many(batch)      # content_block_* / message_delta / [afm_profile] / message_stop
        if writer.stop_requested: engine.cancel(request_id)
    out = writer.close()                   # end of the engine stream
    writer.encode(out)                     # SSE bytes: b"event: NAME\\ndata: {...}\\n\\n"
    writer.message()                       # the non-streaming ``Message``

:class:`Writer` wraps a :class:`MessageStream` in the one writer protocol
(:mod:`afm_core.api.writer`) the HTTP driver runs.

What maps to what:

* ``system`` (a string or text blocks) and ``system``-role entries inside
  ``messages`` become one leading system message (sources joined by a blank
  line, in order).  Consecutive turns of one role are merged (Anthropic
  combines them too).  Text blocks of one content join with ``"\\n"``.
* ``tool_use`` blocks become the assistant's tool calls (``input`` as JSON
  arguments); ``tool_result`` blocks become tool messages (before the
  turn's text); ``thinking`` blocks become the assistant's reasoning;
  ``redacted_thinking`` is dropped.  Images and documents are refused
  (400, the model reads text only), but in a ``tool_result`` each is a note
  that it was left out (refused, an agent's session would be stuck: every
  later request carries it).  Server tools (``web_search_*``,
  ``web_fetch_*``, ``code_execution_*``, ``tool_search_tool_*``: Anthropic
  runs them) are not offered to the model, and the response's
  ``X-AFM-Skipped-Tools`` header names them; typed client tools
  (``bash_*``, ``text_editor_*``, ``computer_*``) are refused (400).
* ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` are the engine's
  ``auto`` / ``required`` / a named function / ``none``;
  ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
* ``thinking`` ``enabled`` (or ``adaptive``) turns the template's reasoning
  mode on (the engine's ``enable_thinking``), ``disabled`` off; absent, the
  model's default.  ``budget_tokens`` is validated as Anthropic does but
  not enforced (thinking counts toward ``max_tokens``).
  ``output_config.effort`` is ``reasoning_effort``; ``output_config.format``
  is a strict ``json_schema`` response format.
* ``stop_sequences`` are matched here, on the answer's text (not on thinking
  or tool input), with the stream core's :class:`StopMatcher`: the matched
  sequence and what follows are never sent; :attr:`MessageStream.stop_requested`
  tells the caller to end the engine request (``engine.cancel``).  The engine
  cannot say which stop string ended a stream, and Anthropic reports it.
* Stop reasons: ``stop`` is ``end_turn``, ``tool_calls`` is ``tool_use``,
  ``length`` is ``max_tokens`` (or ``model_context_window_exceeded`` when
  the prompt and output filled the context), a matched stop sequence is
  ``stop_sequence``, and ``cancelled`` (``engine.cancel``) is ``end_turn``:
  the turn ended early, cleanly, with everything generated so far.
* ``cache_control`` breakpoints (on tools, ``system`` blocks and message
  blocks; ``ttl`` ``5m``, the default, or ``1h``) become the request's
  ``cache_breakpoints``: the engine pins the prompt's prefix up to each in
  its prefix cache for the ttl.  A message block's breakpoint covers its
  whole message.
* Usage: ``input_tokens`` at ``message_start`` is the whole prompt; the final
  ``message_delta`` splits it as Anthropic counts: ``cache_read_input_tokens``
  (read from the engine's prefix cache), ``cache_creation_input_tokens``
  (the prefix up to the last breakpoint not read from it: newly written)
  and ``input_tokens`` (the rest, after the last breakpoint); the three add
  up to the prompt.  ``output_tokens`` is every generated token.

A stream opened with a profile (the ``X-AFM-Profile`` header: the engine's
one :class:`Profile` event, after its usage) is told so with
``MessageStream(profile=True)``: ``message_stop`` waits for the profile, and
between ``message_delta`` and ``message_stop`` comes an ``afm_profile``
event, ``{"type": "afm_profile", "afm_profile": {...}}`` (or
``"afm_profile_extended"``: the same object as chat's ``afm_profile*``).
The SDK passes unknown event types through (its stream helpers skip them);
the non-streaming :meth:`MessageStream.message` carries the object as a
top-level ``afm_profile`` (or ``afm_profile_extended``) field, which the
SDK's ``Message`` keeps as an extra field.  No profile follows a failure.

A stream opened with ``progress=True`` (the ``X-AFM-Progress: true`` header)
also carries ``prompt_progress`` events (``{"type": "prompt_progress",
"prompt_progress": {total, cache, processed, time_ms}}``) while the prompt is
prefilled; the SDK passes unknown event types through.

Errors use Anthropic's envelope (:func:`error_body`); :func:`error_status`
and :func:`error_type` map afm's errors and HTTP statuses to Anthropic's
(an :class:`EngineBusyError` is 529 ``overloaded_error``).

The request half (:func:`parse_request`, :class:`MessagesRequest`,
``count_tokens``) lives in :mod:`afm_core.api.anthropic_request`; this module
is their public face.

May import :mod:`afm_core._stream`, :mod:`afm_core._errors` and the standard
library only.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

from .._errors import AFMError, EngineBusyError, GenerationError
from .._stream.events import (
    ContentDelta,
    Finish,
    Profile,
    PromptProgress,
    ReasoningDelta,
    StreamFailure,
    ToolCallDelta,
    Usage,
)
from .._stream.sse import dumps
from .._stream.stops import StopMatcher
from .anthropic_request import (
    MAX_STOP_SEQUENCES,
    MessagesRequest,
    count_tokens_result,
    parse_count_tokens,
    parse_request,
    prompt_too_long,
    to_chat_request,
)

__all__ = [
    "MAX_STOP_SEQUENCES",
    "MessageStream",
    "MessagesRequest",
    "Writer",
    "count_tokens_result",
    "encode_event",
    "error_body",
    "error_status",
    "error_type",
    "new_message_id",
    "parse_count_tokens",
    "parse_request",
    "prompt_too_long",
    "to_chat_request",
]

# -- errors ---------------------------------------------------------------------------

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_status(exc: AFMError) -> int:
    """The HTTP status Anthropic would answer ``exc`` with: the error's own
    hint, except a full queue (:class:`EngineBusyError`), which is 529."""
    if isinstance(exc, EngineBusyError):
        return 529
    return exc.status if 400 <= exc.status <= 599 else 500


def error_body(message: str, *, status: int, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error envelope ``{"type": "error", "error": {"type", "message"}}``."""
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(status), "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


# -- responses --------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def _tool_id(call_id: str | None) -> str:
    if not call_id:
        return f"toolu_{secrets.token_hex(12)}"
    return "toolu_" + call_id.removeprefix("call_")


def encode_event(event: dict[str, Any]) -> bytes:
    """One SSE frame: ``event: TYPE`` then the event as JSON."""
    return b"event: " + event["type"].encode("ascii") + b"\ndata: " + dumps(event) + b"\n\n"


_FAILURE_TYPES = {"server_error": "api_error", "invalid_request_error": "invalid_request_error"}

TEXT, THINKING, TOOL = "text", "thinking", "tool_use"


class MessageStream:
    """One response: engine events in, Anthropic stream events (dicts) out.

    The same events build the non-streaming :meth:`message`.  Not thread-safe;
    one per request.  See the module docstring for the mapping.
    """

    def __init__(self, *, model: str, input_tokens: int = 0, id: str | None = None,
                 stop_sequences: Sequence[str] = (), context_length: int | None = None,
                 show_thinking: bool = True, profile: bool = False) -> None:
        self.id = id or new_message_id()
        self.model = model
        self.input_tokens = input_tokens
        self.context_length = context_length
        self.show_thinking = show_thinking
        self._content: list[dict[str, Any]] = []  # the Message's blocks so far
        self._args: dict[int, list[str]] = {}  # block index -> tool argument pieces
        # block index -> text / thinking pieces, joined by message() (a string
        # grown by += would copy the whole answer at every token)
        self._pieces: dict[int, list[str]] = {}
        self._open: str | None = None  # the open block's kind
        self._tool_blocks: dict[int, int] = {}  # engine tool-call index -> block index
        self._blank = ""  # whitespace-only text held before a text block opens
        self._stop_list = tuple(s for s in stop_sequences if s)
        self._stops = StopMatcher(self._stop_list) if self._stop_list else None
        self._held = ""  # the stop matcher's held tail (a possible stop prefix)
        self.stop_sequence: str | None = None
        """The stop sequence that ended the answer, once matched."""
        self.finish_reason: str | None = None
        """The engine's finish reason (``stop``, ``length``, ``tool_calls``, ``cancelled``)."""
        self.stop_reason: str | None = None
        self._usage: Usage | None = None
        self.failure: dict[str, Any] | None = None
        """The error body, if the stream failed."""
        self.ended = False
        """``message_stop`` or an error was emitted: nothing follows."""
        self._expect_profile = profile  # message_stop waits for the engine's profile
        self.profile: Profile | None = None
        """The engine's profile, once it arrived."""
        self._delta_sent = False  # message_delta was emitted

    # -- the engine's side -------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        """A stop sequence matched before the engine finished: end the engine
        request now (``engine.cancel(request_id)``); what it still sends is dropped."""
        return self.stop_sequence is not None and self.finish_reason is None and not self.ended

    def start(self) -> list[dict[str, Any]]:
        """``message_start`` and a first ``ping``."""
        message: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}, self.ping()]

    @staticmethod
    def ping() -> dict[str, Any]:
        return {"type": "ping"}

    def feed(self, event: object) -> list[dict[str, Any]]:
        """The Anthropic events for one engine event."""
        out: list[dict[str, Any]] = []
        if type(event) is Profile:
            if not self.ended:  # (after message_stop, or an error, it has no place)
                self.profile = event
                if self._delta_sent:
                    self._end(out)  # the held message_stop
            return out
        if self.ended:
            return out
        answering = self.stop_sequence is None and self.finish_reason is None
        match event:
            case ContentDelta(text=text):
                if answering:
                    self._answer(text, out)
            case ReasoningDelta(text=text):
                if answering and text:
                    self._release(out)
                    self._thinking(text, out)
            case ToolCallDelta():
                if answering:
                    self._release(out)
                    self._tool(event, out)
            case Finish(reason=reason):
                if self.finish_reason is None:
                    self._release(out)
                    self._close_block(out)
                    self.finish_reason = reason
                    if self._usage is not None:
                        self._end(out)
            case Usage():
                if self._delta_sent:
                    return out  # a second usage changes nothing already sent
                self._usage = event
                if self.finish_reason is not None:
                    self._end(out)
            case StreamFailure(message=message, type=kind):
                out.extend(self.fail(message, type=kind))
            case PromptProgress():
                out.append({"type": "prompt_progress", "prompt_progress": event.to_dict()})
        return out  # logprobs have no Anthropic form

    def feed_many(self, events: Iterable[object]) -> list[dict[str, Any]]:
        """The events for one engine step; consecutive deltas of one block are merged."""
        out: list[dict[str, Any]] = []
        for event in events:
            for item in self.feed(event):
                if out and item["type"] == "content_block_delta" and _merge(out[-1], item):
                    continue
                out.append(item)
        return out

    def close(self) -> list[dict[str, Any]]:
        """The engine stream ended: what is still owed (an error if it never finished)."""
        out: list[dict[str, Any]] = []
        if self.ended:
            return out
        if self.finish_reason is None:
            return self.fail("the stream ended before it finished")
        self._expect_profile = False  # none came: message_stop without it
        self._end(out)
        return out

    def fail(self, message: str, *, type: str = "api_error") -> list[dict[str, Any]]:
        """An ``error`` event; the stream ends there."""
        if self.ended:
            return []
        self.ended = True
        self.failure = {"type": "error",
                        "error": {"type": _FAILURE_TYPES.get(type, "api_error"), "message": message}}
        return [self.failure]

    @staticmethod
    def encode(events: Iterable[dict[str, Any]]) -> bytes:
        """SSE bytes for ``events``."""
        if isinstance(events, list) and len(events) == 1:  # the common step: one event
            return encode_event(events[0])
        return b"".join(encode_event(e) for e in events)

    # -- the non-streaming response ----------------------------------------------

    def message(self) -> dict[str, Any]:
        """The ``Message`` (call after :meth:`close`); :class:`GenerationError` if the stream failed."""
        if self.failure is not None:
            raise GenerationError(self.failure["error"]["message"])
        content = []
        for i, block in enumerate(self._content):
            block = dict(block)
            if block["type"] == TOOL:
                block["input"] = _tool_input("".join(self._args.get(i, ())))
            elif block["type"] in (TEXT, THINKING):
                block[block["type"]] = "".join(self._pieces.get(i, ()))
            content.append(block)
        out: dict[str, Any] = {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
            "usage": self._usage_dict()}
        if self.profile is not None:
            out[self.profile.key] = self.profile.payload
        return out

    # -- internals -----------------------------------------------------------------

    def _usage_dict(self) -> dict[str, Any]:
        usage = self._usage
        if usage is None:
            return {"input_tokens": self.input_tokens, "output_tokens": 0,
                    "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        written = min(usage.cache_write_tokens, usage.prompt_tokens - cached)
        return {"input_tokens": usage.prompt_tokens - cached - written, "output_tokens": usage.completion_tokens,
                "cache_creation_input_tokens": written, "cache_read_input_tokens": cached}

    def _stop_reason(self) -> str:
        reason = self.finish_reason
        if self.stop_sequence is not None:
            return "stop_sequence"
        if reason == "tool_calls":
            return "tool_use"
        if reason == "length":
            usage, ctx = self._usage, self.context_length
            if usage is not None and ctx and usage.prompt_tokens + usage.completion_tokens >= ctx:
                return "model_context_window_exceeded"
            return "max_tokens"
        return "end_turn"  # stop, and cancelled: the turn ended, with what was generated

    def _end(self, out: list[dict[str, Any]]) -> None:
        """``message_delta`` (once), then the profile (when there is one) and
        ``message_stop``; with a profile expected and not here yet, the stop waits."""
        if not self._delta_sent:
            self._delta_sent = True
            self.stop_reason = self._stop_reason()
            out.append({"type": "message_delta",
                        "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                        "usage": self._usage_dict()})
        if self.profile is None and self._expect_profile:
            return
        if self.profile is not None:
            out.append({"type": "afm_profile", self.profile.key: self.profile.payload})
        out.append({"type": "message_stop"})
        self.ended = True

    def _answer(self, text: str, out: list[dict[str, Any]]) -> None:
        stops = self._stops
        if stops is not None:
            buf = self._held + text
            released, stopped = stops.feed(text)
            if stopped:
                cut = len(released)
                self.stop_sequence = next(s for s in self._stop_list if buf.startswith(s, cut))
                self._held = ""
                self._text(released, out)
                self._blank = ""
                self._close_block(out)  # the answer ends here; the engine is told to stop
                return
            self._held = buf[len(released):]
            text = released
        self._text(text, out)

    def _release(self, out: list[dict[str, Any]]) -> None:
        """The answer's text run ended: what the stop matcher held is text after all."""
        if self._stops is not None and self._held:
            self._held = ""
            self._text(self._stops.flush(), out)
        self._blank = ""

    def _text(self, text: str, out: list[dict[str, Any]]) -> None:
        if not text:
            return
        if self._open != TEXT:
            if not (self._blank + text).strip():
                self._blank += text  # a text block opens with more than whitespace
                return
            text, self._blank = self._blank + text, ""
            self._open_block({"type": "text", "text": ""}, TEXT, out)
        index = len(self._content) - 1
        self._pieces.setdefault(index, []).append(text)
        out.append({"type": "content_block_delta", "index": index,
                    "delta": {"type": "text_delta", "text": text}})

    def _thinking(self, text: str, out: list[dict[str, Any]]) -> None:
        if self._open != THINKING:
            self._open_block({"type": "thinking", "thinking": "", "signature": ""}, THINKING, out)
        if not self.show_thinking:
            return
        index = len(self._content) - 1
        self._pieces.setdefault(index, []).append(text)
        out.append({"type": "content_block_delta", "index": index,
                    "delta": {"type": "thinking_delta", "thinking": text}})

    def _tool(self, event: ToolCallDelta, out: list[dict[str, Any]]) -> None:
        index = self._tool_blocks.get(event.index)
        if index is None:  # a new call (the trackers emit one call at a time)
            self._open_block({"type": TOOL, "id": _tool_id(event.id), "name": event.name or "",
                              "input": {}}, TOOL, out)
            index = len(self._content) - 1
            self._tool_blocks[event.index] = index
            self._args[index] = []
        if event.arguments:
            self._args[index].append(event.arguments)
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": event.arguments}})

    def _open_block(self, block: dict[str, Any], kind: str, out: list[dict[str, Any]]) -> None:
        self._close_block(out)
        self._content.append(block)
        self._open = kind
        out.append({"type": "content_block_start", "index": len(self._content) - 1,
                    "content_block": dict(block)})

    def _close_block(self, out: list[dict[str, Any]]) -> None:
        if self._open is not None:
            out.append({"type": "content_block_stop", "index": len(self._content) - 1})
            self._open = None


def _merge(last: dict[str, Any], item: dict[str, Any]) -> bool:
    """Append delta ``item`` to ``last`` when both extend the same block the same way."""
    if last["type"] != "content_block_delta" or last["index"] != item["index"]:
        return False
    a, b = last["delta"], item["delta"]
    if a["type"] != b["type"]:
        return False
    key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[a["type"]]
    last["delta"] = {"type": a["type"], key: a[key] + b[key]}
    return True


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's ``input``: its JSON arguments as an object (``{}`` when the model
    wrote none, or wrote something that is not a JSON object; the stream
    carried the text as written)."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class Writer:
    """One Messages response: the writer protocol (:class:`afm_core.api.writer.Writer`)
    over a :class:`MessageStream` (one choice).  Streamed: ``event: TYPE`` frames
    (``message_start`` and a ``ping`` first, a ``ping`` as the keepalive); the
    non-streamed ``Message`` is :meth:`result`.  :attr:`stop_requested` asks the
    caller to end the engine request (a stop sequence matched)."""

    media_type = "text/event-stream"

    def __init__(self, state: MessageStream, *, stream: bool = True) -> None:
        self.state = state
        self.streaming = stream

    @property
    def done(self) -> bool:
        return self.state.ended

    @property
    def stop_requested(self) -> bool:
        return self.state.stop_requested

    def ended(self, choice: int = 0) -> bool:
        return self.state.ended

    def _out(self, events: list[dict[str, Any]]) -> bytes:
        return self.state.encode(events) if self.streaming and events else b""

    def start(self) -> bytes:
        return self._out(self.state.start()) if self.streaming else b""

    def feed(self, choice: int, events: Sequence[object]) -> bytes:
        out = self.state.feed_many(events)
        return self.state.encode(out) if self.streaming and out else b""

    def close(self, choice: int = 0) -> bytes:
        return self._out(self.state.close())

    def keepalive(self) -> bytes:
        return self._out([self.state.ping()])

    def fail(self, message: str) -> bytes:
        return self._out(self.state.fail(message))

    def end(self) -> bytes:
        return self._out(self.state.close())  # what is still owed (nothing once it ended)

    def result(self) -> dict[str, Any]:
        return self.state.message()
