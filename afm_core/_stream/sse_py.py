"""SSE frame encoder: stream events to ``data: {...}\\n\\n`` bytes (pure twin).

One :class:`SSEEncoder` per stream.  Content, reasoning and tool-argument
deltas are hot: their frames are a precomputed prefix, the JSON-escaped text
and a precomputed suffix.  Everything else is built as a dict (:meth:`chunk`,
also the non-streaming path's input) and serialised with :func:`dumps`.

JSON text is UTF-8 (``ensure_ascii=False``): the bytes equal
``json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()``,
except that a lone surrogate, which UTF-8 cannot carry, is written as a
``\\udXXX`` escape instead of crashing.  Logprobs are clamped to
``[-9999.0, 0.0]`` (``-inf``/NaN become ``-9999.0``; strict JSON has no
infinities).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

from .events import (
    ContentDelta,
    Event,
    Finish,
    LogprobsDelta,
    Profile,
    PromptProgress,
    ReasoningDelta,
    StreamFailure,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    clamp_logprob,
)

__all__ = ["DONE", "SSEEncoder", "dumps", "escape_json_string", "frame"]

DONE = b"data: [DONE]\n\n"
_ERRORS = "afm.json_surrogates"


def _escape_surrogates(exc: UnicodeError) -> tuple[str, int]:
    # Lone surrogates only occur inside JSON strings, so an escape is exact.
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    bad = exc.object[exc.start : exc.end]
    return "".join(f"\\u{ord(c):04x}" for c in bad), exc.end


codecs.register_error(_ERRORS, _escape_surrogates)


def escape_json_string(text: str) -> bytes:
    """``text`` as a quoted JSON string literal in UTF-8."""
    return encode_basestring(text).encode("utf-8", _ERRORS)  # type: ignore[no-any-return]


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))`` without
building a new encoder for every call (which costs more than the encoding)."""


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON of ``obj`` (lone surrogates escaped): exactly
    ``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))``."""
    return _ENCODER.encode(obj).encode("utf-8", _ERRORS)


def frame(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + dumps(obj) + b"\n\n"


def token_logprob(entry: TokenLogprob) -> dict[str, Any]:
    """One ``logprobs.content[]`` entry of a chat chunk (also the non-streamed answer's)."""
    return {
        "token": entry.token,
        "logprob": clamp_logprob(entry.logprob),
        "bytes": list(entry.bytes) if entry.bytes is not None else None,
        "top_logprobs": [
            {
                "token": top.token,
                "logprob": clamp_logprob(top.logprob),
                "bytes": list(top.bytes) if top.bytes is not None else None,
            }
            for top in entry.top_logprobs
        ],
    }


def _logprobs(event: LogprobsDelta) -> dict[str, Any]:
    return {"content": [token_logprob(e) for e in event.content]}


def _tool_call(event: ToolCallDelta) -> dict[str, Any]:
    call: dict[str, Any] = {"index": event.index}
    if event.id is not None:
        call["id"] = event.id
    if event.id is not None or event.name is not None:
        call["type"] = "function"
    function: dict[str, Any] = {}
    if event.name is not None:
        function["name"] = event.name
    function["arguments"] = event.arguments
    call["function"] = function
    return call


class SSEEncoder:
    """Encode one stream's events as ``chat.completion.chunk`` SSE frames.

    The first choice chunk carries ``delta.role: "assistant"``.  A
    ``LogprobsDelta`` directly after a content/reasoning delta in one
    :meth:`encode_many` batch rides in that delta's chunk.  ``index`` is the
    choice the stream is (``choices[0].index``; a request with ``n`` > 1 runs
    one stream, and one encoder, per choice); the usage, error, profile and
    prompt-progress (``choices: []`` with llama.cpp's ``prompt_progress``
    object) chunks carry no choice.
    """

    def __init__(
        self,
        id: str,
        created: int,
        model: str,
        *,
        system_fingerprint: str | None = None,
        index: int = 0,
    ) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"the choice index must be a non-negative int, not {index!r}")
        self.id = id
        self.created = created
        self.model = model
        self.system_fingerprint = system_fingerprint
        self.index = int(index)
        self._role_pending = True
        head: dict[str, Any] = {
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        if system_fingerprint is not None:
            head["system_fingerprint"] = system_fingerprint
        self._head = head
        top = dumps(head)[:-1] + b',"choices":[{"index":%d,"delta":{' % self.index
        self._top = b"data: " + top
        self._role = b'"role":"assistant",'
        self._tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        self._tool_index = -1
        self._tool_prefix = b""

    # -- dict form -----------------------------------------------------

    def _choice_chunk(self, delta: dict[str, Any], logprobs: Any, finish: str | None) -> dict[str, Any]:
        if self._role_pending:
            self._role_pending = False
            delta = {"role": "assistant", **delta}
        chunk = dict(self._head)
        chunk["choices"] = [
            {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        ]
        return chunk

    def _delta(self, event: Event) -> dict[str, Any] | None:
        if type(event) is ContentDelta:
            return {"content": event.text}
        if type(event) is ReasoningDelta:
            return {"reasoning_content": event.text}
        if type(event) is ToolCallDelta:
            return {"tool_calls": [_tool_call(event)]}
        return None

    def chunk(self, event: Event) -> dict[str, Any]:
        """The chunk object for ``event`` (advances the role state)."""
        delta = self._delta(event)
        if delta is not None:
            return self._choice_chunk(delta, None, None)
        if type(event) is LogprobsDelta:
            return self._choice_chunk({}, _logprobs(event), None)
        if type(event) is Finish:
            return self._choice_chunk({}, None, event.reason)
        if type(event) is Usage:
            chunk = dict(self._head)
            chunk["choices"] = []
            chunk["usage"] = event.to_dict()
            return chunk
        if type(event) is Profile:
            return {event.key: event.payload}
        if type(event) is PromptProgress:
            chunk = dict(self._head)
            chunk["choices"] = []
            chunk["prompt_progress"] = event.to_dict()
            return chunk
        if type(event) is StreamFailure:
            chunk = dict(self._head)
            chunk["choices"] = []
            chunk["error"] = event.to_dict()
            return chunk
        raise TypeError(f"not a stream event: {event!r}")

    def chunks(self, events: Iterable[Event]) -> list[dict[str, Any]]:
        """Chunk objects for a batch, merging logprobs as :meth:`encode_many` does."""
        out: list[dict[str, Any]] = []
        items = list(events)
        i, n = 0, len(items)
        while i < n:
            event = items[i]
            nxt = items[i + 1] if i + 1 < n else None
            if type(nxt) is LogprobsDelta and type(event) in (ContentDelta, ReasoningDelta):
                delta = self._delta(event)
                assert delta is not None
                out.append(self._choice_chunk(delta, _logprobs(nxt), None))
                i += 2
                continue
            out.append(self.chunk(event))
            i += 1
        return out

    # -- bytes form ----------------------------------------------------

    def _text_frame(self, key: bytes, text: str) -> bytes:
        if self._role_pending:
            self._role_pending = False
            return self._top + self._role + key + escape_json_string(text) + self._tail
        return self._top + key + escape_json_string(text) + self._tail

    def encode(self, event: Event) -> bytes:
        """One SSE frame for ``event``."""
        kind = type(event)
        if kind is ContentDelta:
            return self._text_frame(b'"content":', event.text)  # type: ignore[union-attr]
        if kind is ReasoningDelta:
            return self._text_frame(b'"reasoning_content":', event.text)  # type: ignore[union-attr]
        if kind is ToolCallDelta and event.id is None and event.name is None:  # type: ignore[union-attr]
            return self._tool_args_frame(event)  # type: ignore[arg-type]
        return frame(self.chunk(event))

    def _tool_args_frame(self, event: ToolCallDelta) -> bytes:
        if self._role_pending:
            return frame(self.chunk(event))
        if event.index != self._tool_index:
            self._tool_index = event.index
            self._tool_prefix = (
                b'"tool_calls":[{"index":%d,"function":{"arguments":' % event.index
            )
        return self._top + self._tool_prefix + escape_json_string(event.arguments) + b"}}]" + self._tail

    def encode_many(self, events: Iterable[Event]) -> bytes:
        """The frames of one step's events as one bytes object."""
        items = events if isinstance(events, list) else list(events)
        n = len(items)
        if n == 1:
            return self.encode(items[0])
        out: list[bytes] = []
        i = 0
        while i < n:
            event = items[i]
            if (
                i + 1 < n
                and type(items[i + 1]) is LogprobsDelta
                and type(event) in (ContentDelta, ReasoningDelta)
            ):
                out.extend(frame(c) for c in self.chunks(items[i : i + 2]))
                i += 2
                continue
            out.append(self.encode(event))
            i += 1
        return b"".join(out)

    def done(self) -> bytes:
        """The transport terminator ``data: [DONE]``."""
        return DONE
