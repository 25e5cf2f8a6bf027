"""OpenAI Chat Completions (``POST /v1/chat/completions``) as a sans-IO translation.

::

    request = chat.parse(body)              # ChatRequest; raises RequestError
    # one engine stream per choice: request.per_choice() (request.n of them)
    writer = chat.Writer(id=stream.id, created=stream.created, model=stream.model,
                         choices=request.n, stream=request.stream,
                         include_usage=request.include_usage)
    writer.feed(i, batch) ... writer.end()  # SSE bytes (the protocol of .writer)
    writer.result()                         # with stream=False: the chat.completion

The request: :meth:`ChatRequest.from_openai <afm_core.api.chat_request.ChatRequest.from_openai>`.

The stream: each choice's events through its own :class:`~afm_core.SSEEncoder`
(``index=i``, the Cython build on the hot path), so the chunks of every choice
interleave one write per engine step, as OpenAI's do.  Each choice's usage and
the profile are held back: once every choice finished, one usage chunk (when
``stream_options.include_usage`` asks) counts the prompt once and the
completion tokens of every choice, then the profile objects (``afm_profile``,
choice 0's), then ``data: [DONE]``.  A failure (a choice's error event, its
stream ending without a finish, :meth:`Writer.fail`) is an error-marked chunk
(``choices: []``, ``error``): nothing of any choice follows it, no usage.

The non-streamed ``chat.completion`` is folded from the same events (no frames
are built): each choice's ``message`` (``content``, ``reasoning_content``,
``tool_calls`` with their argument strings), its ``logprobs`` and
``finish_reason``, the joined usage, the profile as a top-level field.  An
empty answer is ``content: ""`` (``null`` only beside tool calls), as
OpenAI's.  A failed choice makes :meth:`Writer.result` raise
:class:`~afm_core.GenerationError`.

May import: :mod:`afm_core._stream`, :mod:`afm_core._errors`, the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._errors import GenerationError, RequestError
from .._stream.events import (
    ContentDelta,
    Event,
    Finish,
    LogprobsDelta,
    Profile,
    ReasoningDelta,
    StreamFailure,
    ToolCallDelta,
    Usage,
)
from .._stream.sse import DONE, SSEEncoder
from .._stream.sse_py import token_logprob
from .chat_request import MAX_N, ChatRequest
from .writer import INTERRUPTED, SSE_KEEPALIVE

__all__ = ["MAX_N", "Writer", "error_body", "joined_usage", "parse"]


def parse(body: Any) -> ChatRequest:
    """Validate an OpenAI chat completion body (raises :class:`~afm_core.RequestError`)."""
    return ChatRequest.from_openai(body)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error envelope ``{"error": {"message", "type", "param", "code"}}``
    (the OpenAI-shaped APIs' errors before a stream began)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def joined_usage(usages: Sequence[Usage]) -> Usage:
    """One usage for several choices of one prompt: the first one's prompt (counted
    once) and cached tokens, every choice's completion tokens."""
    first = usages[0]
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages), first.cached_tokens)


class _Answer:
    """One choice's message while the non-streamed answer is folded."""

    __slots__ = ("content", "finish", "logprobs", "reasoning", "tools")

    def __init__(self) -> None:
        self.content: list[str] | None = None
        self.reasoning: list[str] | None = None
        self.tools: dict[int, list[Any]] = {}  # index -> [id, name, [argument pieces]]
        self.logprobs: list[dict[str, Any]] | None = None
        self.finish: str | None = None

    def message(self) -> dict[str, Any]:
        content = "".join(self.content) if self.content is not None else None
        if content is None and not self.tools:
            content = ""  # an empty answer is "", as OpenAI's; null only beside tool calls
        out: dict[str, Any] = {
            "role": "assistant",
            "content": content,
            "reasoning_content": "".join(self.reasoning) if self.reasoning is not None else None,
        }
        if self.tools:
            out["tool_calls"] = [{"id": call[0], "type": "function",
                                  "function": {"name": call[1], "arguments": "".join(call[2])}}
                                 for _, call in sorted(self.tools.items())]
        return out


class Writer:
    """One chat completion, every choice: engine events in, ``chat.completion.chunk``
    SSE frames (``stream=True``) or the ``chat.completion`` (``stream=False``) out.

    The protocol of :class:`afm_core.api.writer.Writer`; see the module docstring.
    """

    media_type = "text/event-stream"
    stop_requested = False

    def __init__(self, *, id: str, created: int, model: str, choices: int = 1, stream: bool = True,
                 include_usage: bool = False, system_fingerprint: str | None = None) -> None:
        if choices < 1:
            raise ValueError("a chat completion has at least one choice")
        self.id = id
        self.created = created
        self.model = model
        self.system_fingerprint = system_fingerprint
        self.streaming = stream
        self.include_usage = include_usage
        self._encoders = [SSEEncoder(id, created, model, system_fingerprint=system_fingerprint, index=i)
                          for i in range(choices)] if stream else []
        self._answers = [] if stream else [_Answer() for _ in range(choices)]
        self._ended = [False] * choices
        self._open = choices
        self._usage: list[Usage | None] = [None] * choices
        self._profiles: list[Profile] = []
        self.failure: StreamFailure | None = None
        """The failure that ended the response, if one did."""

    # -- state -----------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.failure is not None or self._open == 0

    def ended(self, choice: int) -> bool:
        return self._ended[choice] or self.failure is not None

    # -- the stream ------------------------------------------------------------------

    def start(self) -> bytes:
        return b""

    def feed(self, choice: int, events: Sequence[Event]) -> bytes:
        if self.failure is not None or self._ended[choice]:
            return b""  # nothing of any choice follows a failure, nor of a choice its end
        if not self.streaming:
            self._fold(choice, events)
            return b""
        if len(events) == 1:  # the common step: one delta
            kind = type(events[0])
            if kind is ContentDelta or kind is ReasoningDelta or kind is ToolCallDelta:
                return self._encoders[choice].encode(events[0])
        return self._frames(choice, events)

    def _frames(self, choice: int, events: Sequence[Event]) -> bytes:
        sent: list[Event] = []
        finished = False
        for event in events:
            kind = type(event)
            if kind is Usage:
                self._usage[choice] = event  # type: ignore[assignment]
            elif kind is Profile:
                self._profiles.append(event)  # type: ignore[arg-type]
            else:
                sent.append(event)
                if kind is Finish:
                    finished = True
                elif kind is StreamFailure:
                    self.failure = event  # type: ignore[assignment]
                    break
        out = self._encoders[choice].encode_many(sent) if sent else b""
        if finished and self.failure is None:
            self._end_choice(choice)
            if self._open == 0:
                out += self._tail()
        return out

    def _end_choice(self, choice: int) -> None:
        self._ended[choice] = True
        self._open -= 1

    def _tail(self) -> bytes:
        """After the last finish: the usage of every choice (when asked), then the profile."""
        out = []
        usages = [u for u in self._usage if u is not None]
        if self.include_usage and usages:
            out.append(self._encoders[0].encode(joined_usage(usages)))
        out += [self._encoders[0].encode(p) for p in self._profiles]
        return b"".join(out)

    def close(self, choice: int) -> bytes:
        if self.failure is not None or self._ended[choice]:
            return b""
        self.failure = INTERRUPTED  # the engine closed the stream without a finish
        return self._encoders[choice].encode(INTERRUPTED) if self.streaming else b""

    def keepalive(self) -> bytes:
        return SSE_KEEPALIVE if self.streaming else b""

    def fail(self, message: str) -> bytes:
        if self.done:
            return b""  # (after the last choice's end nothing fails)
        self.failure = StreamFailure(message, code="internal_error")
        return self._encoders[0].encode(self.failure) if self.streaming else b""

    def end(self) -> bytes:
        return DONE if self.streaming else b""

    # -- the non-streamed answer -----------------------------------------------------------

    def _fold(self, choice: int, events: Sequence[Event]) -> None:
        answer = self._answers[choice]
        for event in events:
            match event:
                case ContentDelta(text=text):
                    if answer.content is None:
                        answer.content = []
                    answer.content.append(text)
                case ReasoningDelta(text=text):
                    if answer.reasoning is None:
                        answer.reasoning = []
                    answer.reasoning.append(text)
                case ToolCallDelta(index=index, arguments=arguments, id=call_id, name=name):
                    call = answer.tools.setdefault(index, [None, None, []])
                    if call[0] is None:
                        call[0] = call_id
                    if call[1] is None:
                        call[1] = name
                    if arguments:
                        call[2].append(arguments)
                case LogprobsDelta(content=content):
                    if answer.logprobs is None:
                        answer.logprobs = []
                    answer.logprobs += [token_logprob(e) for e in content]
                case Finish(reason=reason):
                    answer.finish = reason
                    self._end_choice(choice)
                case Usage():
                    self._usage[choice] = event
                case Profile():
                    self._profiles.append(event)
                case StreamFailure():
                    self.failure = event
                    return
                # prompt progress has no place in a non-streamed answer

    def result(self) -> dict[str, Any]:
        if self.streaming:
            raise ValueError("a streaming writer builds no result: make it with stream=False")
        if self.failure is not None:
            if self.failure.type == "invalid_request_error":  # the request's fault (a grammar that could not go on)
                raise RequestError(self.failure.message, param=self.failure.param, code=self.failure.code)
            raise GenerationError(self.failure.message or "stream error", code=self.failure.code)
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion", "created": self.created,
                               "model": self.model}
        if self.system_fingerprint is not None:
            out["system_fingerprint"] = self.system_fingerprint
        out["choices"] = [{"index": i, "message": a.message(),
                           "logprobs": {"content": a.logprobs} if a.logprobs is not None else None,
                           "finish_reason": a.finish}
                          for i, a in enumerate(self._answers)]
        usages = [u for u in self._usage if u is not None]
        if usages:
            out["usage"] = joined_usage(usages).to_dict()
        for profile in self._profiles:
            out[profile.key] = profile.payload
        return out
