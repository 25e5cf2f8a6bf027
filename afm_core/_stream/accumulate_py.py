"""Chunk accumulator: the "correct client" of the streaming contract (pure twin).

Feed raw SSE bytes/text, single SSE lines, event data strings or decoded
chunk dicts; get back one ``chat.completion`` dict.  The non-streaming path
feeds ``SSEEncoder.chunk`` dicts and calls :meth:`~ChunkAccumulator.feed_done`.

Each chunk is dispatched on its top-level keys before it is decoded:
``error`` raises :class:`StreamErrorChunk`; ``afm_profile*`` objects are kept
as they are; ``usage`` is recorded; then ``choices`` are merged: content and
reasoning in separate channels, tool calls by ``index`` keeping the first
non-null ``id`` / ``type`` / ``function.name`` and appending every
``arguments`` fragment (kept as the string, like OpenAI; see
:meth:`~ChunkAccumulator.parse_tool_arguments`).  ``[DONE]`` terminates the
stream; anything but blank lines and comments after it is a protocol error.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from .._errors import StreamErrorChunk, StreamProtocolError

__all__ = ["ChunkAccumulator", "accumulate"]

PROFILE_KEYS = ("afm_profile", "afm_profile_extended")


class _Choice:
    __slots__ = ("content", "finish_reason", "index", "logprobs", "reasoning", "role", "tools")

    def __init__(self, index: int) -> None:
        self.index = index
        self.role: str | None = None
        self.content: list[str] | None = None
        self.reasoning: list[str] | None = None
        self.tools: dict[int, list[Any]] = {}  # index -> [id, type, name, [arguments...]]
        self.logprobs: list[Any] | None = None
        self.finish_reason: str | None = None

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": self.role or "assistant",
            "content": "".join(self.content) if self.content is not None else None,
            "reasoning_content": "".join(self.reasoning) if self.reasoning is not None else None,
        }
        if self.tools:
            message["tool_calls"] = [
                {
                    "id": call[0],
                    "type": call[1] or "function",
                    "function": {"name": call[2], "arguments": "".join(call[3])},
                }
                for _, call in sorted(self.tools.items())
            ]
        return message


def _text(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise StreamProtocolError(f"{what} must be a string, got {type(value).__name__}")


class ChunkAccumulator:
    """Assemble one streamed chat completion."""

    def __init__(self) -> None:
        self._buffer = b""
        self._skip_lf = False
        self._data: list[str] = []
        self._done = False
        self._meta: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._profiles: dict[str, Any] = {}

    @property
    def done(self) -> bool:
        """Whether ``[DONE]`` has arrived."""
        return self._done

    # -- transport -----------------------------------------------------

    def feed(self, item: bytes | str | dict[str, Any]) -> None:
        """Feed SSE bytes or text, or one decoded chunk dict."""
        if isinstance(item, dict):
            self.feed_chunk(item)
        elif isinstance(item, str):
            self.feed_bytes(item.encode("utf-8"))
        elif isinstance(item, (bytes, bytearray, memoryview)):
            self.feed_bytes(bytes(item))
        else:
            raise TypeError(f"cannot feed {type(item).__name__}")

    def feed_bytes(self, data: bytes) -> None:
        """Feed raw SSE bytes, split anywhere."""
        if not data:
            return
        if type(data) is not bytes:
            data = bytes(data)
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        buffer = self._buffer + data if self._buffer else data
        lines = buffer.splitlines(keepends=True)
        if lines and not lines[-1].endswith((b"\n", b"\r")):
            self._buffer = lines.pop()
        else:
            self._buffer = b""
        for raw in lines:
            raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise StreamProtocolError(f"SSE line is not UTF-8: {exc}") from None
            self.feed_line(line)
        # A lone CR at the very end may be the first half of a CRLF.
        self._skip_lf = bool(lines) and not self._buffer and lines[-1].endswith(b"\r")

    def feed_line(self, line: str) -> None:
        """Feed one SSE line (without its terminator)."""
        if not line:
            if self._data:
                data = "\n".join(self._data)
                self._data = []
                self.feed_data(data)
            return
        if line[0] == ":":
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value[:1] == " " else value)

    def feed_data(self, data: str) -> None:
        """Feed one event's data: ``[DONE]`` or a JSON chunk."""
        if self._done:
            raise StreamProtocolError("data after [DONE]")
        if data == "[DONE]":
            self._done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise StreamProtocolError(f"chunk is not JSON: {exc}") from None
        self.feed_chunk(chunk)

    def feed_done(self) -> None:
        """The terminator, for chunk-dict feeding."""
        self.feed_data("[DONE]")

    def close(self) -> None:
        """End of the transport: the stream must have ended with ``[DONE]``."""
        self._buffer = b""
        self._data = []
        if not self._done:
            raise StreamProtocolError("stream ended before [DONE]")

    # -- chunks --------------------------------------------------------

    def feed_chunk(self, chunk: dict[str, Any]) -> None:
        """Merge one decoded chunk."""
        if self._done:
            raise StreamProtocolError("data after [DONE]")
        if not isinstance(chunk, dict):
            raise StreamProtocolError(f"chunk must be an object, got {type(chunk).__name__}")
        error = chunk.get("error")
        if error:
            raise StreamErrorChunk(error if isinstance(error, dict) else {"message": str(error)})
        profile = False
        for key in PROFILE_KEYS:
            if key in chunk:
                self._profiles[key] = chunk[key]
                profile = True
        if profile:
            return
        meta = self._meta
        for key in ("id", "created", "model", "system_fingerprint"):
            value = chunk.get(key)
            if value is not None and meta.get(key) is None:
                meta[key] = value
        usage = chunk.get("usage")
        if usage is not None:
            if not isinstance(usage, dict):
                raise StreamProtocolError("usage must be an object")
            self._usage = usage
        choices = chunk.get("choices")
        if choices is None:
            if usage is None:
                raise StreamProtocolError("chunk has no choices, usage, error or profile")
            return
        if not isinstance(choices, list):
            raise StreamProtocolError("choices must be an array")
        for choice in choices:
            self._merge_choice(choice)

    def _merge_choice(self, choice: Any) -> None:
        if not isinstance(choice, dict):
            raise StreamProtocolError("a choice must be an object")
        index = choice.get("index", 0)
        if type(index) is not int:
            raise StreamProtocolError("choice index must be an integer")
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _Choice(index)
        delta = choice.get("delta")
        if delta is None:
            delta = {}
        elif not isinstance(delta, dict):
            raise StreamProtocolError("delta must be an object")
        role = _text(delta.get("role"), "delta.role")
        if role is not None and state.role is None:
            state.role = role
        content = _text(delta.get("content"), "delta.content")
        if content is not None:
            if state.content is None:
                state.content = []
            state.content.append(content)
        reasoning = _text(delta.get("reasoning_content"), "delta.reasoning_content")
        if reasoning is None:
            reasoning = _text(delta.get("reasoning"), "delta.reasoning")
        if reasoning is not None:
            if state.reasoning is None:
                state.reasoning = []
            state.reasoning.append(reasoning)
        calls = delta.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise StreamProtocolError("delta.tool_calls must be an array")
            for call in calls:
                self._merge_tool_call(state, call)
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            if not isinstance(logprobs, dict):
                raise StreamProtocolError("logprobs must be an object")
            entries = logprobs.get("content")
            if entries is not None:
                if not isinstance(entries, list):
                    raise StreamProtocolError("logprobs.content must be an array")
                if state.logprobs is None:
                    state.logprobs = []
                state.logprobs.extend(entries)
        finish = _text(choice.get("finish_reason"), "finish_reason")
        if finish is not None:
            state.finish_reason = finish

    @staticmethod
    def _merge_tool_call(state: _Choice, call: Any) -> None:
        if not isinstance(call, dict):
            raise StreamProtocolError("a tool call delta must be an object")
        index = call.get("index")
        if type(index) is not int:
            raise StreamProtocolError("tool call delta without an integer index")
        entry = state.tools.get(index)
        if entry is None:
            entry = state.tools[index] = [None, None, None, []]
        if entry[0] is None:
            entry[0] = _text(call.get("id"), "tool_calls[].id")
        if entry[1] is None:
            entry[1] = _text(call.get("type"), "tool_calls[].type")
        function = call.get("function")
        if function is None:
            return
        if not isinstance(function, dict):
            raise StreamProtocolError("tool_calls[].function must be an object")
        if entry[2] is None:
            entry[2] = _text(function.get("name"), "function.name")
        arguments = _text(function.get("arguments"), "function.arguments")
        if arguments:
            entry[3].append(arguments)

    # -- results -------------------------------------------------------

    def result(self) -> dict[str, Any]:
        """The complete ``chat.completion`` (requires ``[DONE]``)."""
        if not self._done:
            raise StreamProtocolError("stream not finished: no [DONE] yet")
        meta = self._meta
        out: dict[str, Any] = {
            "id": meta.get("id"),
            "object": "chat.completion",
            "created": meta.get("created"),
            "model": meta.get("model"),
        }
        if meta.get("system_fingerprint") is not None:
            out["system_fingerprint"] = meta["system_fingerprint"]
        out["choices"] = [
            {
                "index": c.index,
                "message": c.message(),
                "logprobs": {"content": c.logprobs} if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for _, c in sorted(self._choices.items())
        ]
        if self._usage is not None:
            out["usage"] = self._usage
        out.update(self._profiles)
        return out

    def parse_tool_arguments(self, choice: int = 0) -> list[Any]:
        """Each tool call's arguments parsed as JSON, by index, once the turn ended."""
        if not self._done:
            raise StreamProtocolError("tool arguments are parsed only after the stream ends")
        state = self._choices.get(choice)
        if state is None:
            return []
        parsed: list[Any] = []
        for index, call in sorted(state.tools.items()):
            text = "".join(call[3])
            try:
                parsed.append(json.loads(text))
            except ValueError as exc:
                raise StreamProtocolError(
                    f"tool call {index} arguments are not valid JSON: {exc}"
                ) from None
        return parsed


def accumulate(items: Iterable[bytes | str | dict[str, Any]]) -> dict[str, Any]:
    """Feed a whole stream and return its ``chat.completion``.

    Dict items need no ``[DONE]``; a byte/text stream must carry one.
    """
    acc = ChunkAccumulator()
    dicts_only = True
    for item in items:
        dicts_only = dicts_only and isinstance(item, dict)
        acc.feed(item)
    if dicts_only and not acc.done:
        acc.feed_done()
    acc.close()
    return acc.result()
