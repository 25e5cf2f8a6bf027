"""Tool-call fragment tracker: the hot core (pure twin; ``ext/stream/tools_c.pyx`` mirrors it).

Model text in (arbitrary boundaries), events out: ``ContentDelta`` outside
calls and ``ToolCallDelta`` per call index.  The tracker owns the loops that
run for every token; a wire format (``afm_core._stream.toolcalls``) owns the cold
decisions at call boundaries (see ``afm_core._stream.toolcalls.base``).  Modes:

* ``PASS``   everything is content;
* ``TEXT``   content until the format's start tag (a possible partial tag
  is held back), then ``COLD`` with the tag at the head of the text.  Once
  a call was accepted, trailing whitespace of content is held: it is dropped
  when the next start tag or the end of the stream follows (the layout
  between and after calls is not content) and emitted before other text;
* ``COLD``   the format's ``step(tracker, text)`` decides: it returns how many
  characters it consumed (0: progressed without consuming) or -1 for "need
  more text".  When a scan ends exactly at the end of the text, ``step`` is
  called at once with ``""``, so at ``flush`` a format still in a scan's
  phase knows the scan was cut off;
* ``JSON``   an incremental JSON scanner (string / escape / depth state) finds
  where a value ends; the text goes to a sink: argument fragments (``EMIT``),
  ``CAPTURE`` or ``DROP``.  A character that cannot appear outside a JSON
  string ends the value early and sets ``scan_failed``;
* ``UNTIL``  text up to a tag goes to a sink (``CAPTURE`` / ``DROP``);
* ``STRING`` text up to a terminator streams as a JSON string body (escaped
  argument fragments), optionally without one newline before the terminator.

Each character is looked at a bounded number of times, so total work is
linear in the output.  The first fragment of a call carries ``index``,
``id`` and ``name`` with empty ``arguments``; later ones carry argument
pieces whose concatenation is the call's argument JSON.  When a call closes
its arguments are checked with ``json.loads`` (an object is expected); a
failure is recorded in ``errors``, never raised.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring  # type: ignore[attr-defined]

from .events import ContentDelta, ToolCallDelta
from .toolcalls.base import (
    CAPTURE,
    DROPPED,
    EMIT,
    UNKNOWN,
    ToolCallFailure,
    ToolFormat,
    new_call_id,
    partial,
)

__all__ = ["ToolCallTracker"]

Event = ContentDelta | ToolCallDelta

PASS, TEXT, COLD, JSON, UNTIL, STRING = range(6)

_LITERAL = frozenset("0123456789-+.abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_WS = frozenset(" \t\r\n")


class ToolCallTracker:
    """One stream's tool calls in one wire format; ``feed`` text, ``flush`` at the end."""

    def __init__(
        self,
        fmt: ToolFormat,
        *,
        names: frozenset[str] | None = None,
        parallel_tool_calls: bool = True,
        id_factory: Callable[[], str] = new_call_id,
    ) -> None:
        self.format = fmt
        self._names = names
        self._parallel = parallel_tool_calls
        self._new_id = id_factory
        self._out: list[Event] = []
        self._buf = ""
        self._gap = ""
        self._mode = COLD
        self._tag = ""
        self._sink = EMIT
        self._close = ""
        self._strip_nl = False
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._prim = False
        self._captured: list[str] = []
        self._pieces: list[str] = []
        self._index = -1
        self.scan_failed = False
        self.calls = 0
        self.dropped = 0
        self.errors: list[ToolCallFailure] = []
        fmt.start(self)

    # -- results --------------------------------------------------------------
    @property
    def saw_tool_call(self) -> bool:
        """Whether any call was accepted (finish_reason ``tool_calls``)."""
        return self.calls > 0

    # -- stream ---------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        """Events for one text delta."""
        out: list[Event] = []
        self._out = out
        if self._buf:
            text = self._buf + text
            self._buf = ""
        while text:
            mode = self._mode
            if mode == JSON:
                text = self._scan_json(text)
            elif mode == TEXT:
                text = self._scan_text(text)
            elif mode == STRING:
                text = self._scan_string(text)
            elif mode == UNTIL:
                text = self._scan_until(text)
            elif mode == PASS:
                out.append(ContentDelta(text))
                break
            else:
                used = self.format.step(self, text)
                if used < 0:  # the format needs more text
                    self._buf = text
                    break
                if used:
                    text = text[used:]
                continue
            if not text and self._mode == COLD:
                self.format.step(self, "")  # a scan ended with the text: settle now
        return out

    def flush(self) -> list[Event]:
        """End of stream: release held text; the format settles an unclosed call."""
        out: list[Event] = []
        self._out = out
        text, self._buf = self._buf, ""
        mode = self._mode
        self._mode = COLD
        if mode == PASS or mode == TEXT:
            self.content(text)
            self._gap = ""  # the layout after the last call
            return out
        pending = text
        if mode == STRING:
            if text:
                self.args(encode_basestring(text)[1:-1])
            self.args(self._close)
            pending = ""
        elif mode == JSON or mode == UNTIL:
            pending = "".join(self._captured) + text if self._sink == CAPTURE else ""
            self._captured = []
        self.format.finish(self, pending)
        if self._index >= 0:
            self.close_call()
        return out

    # -- the format's interface ----------------------------------------------
    def content(self, text: str) -> None:
        """Content outside calls; once a call was accepted, trailing whitespace
        is held until other text follows (see ``TEXT`` mode)."""
        if not text:
            return
        if self.calls:
            body = text.rstrip()
            if not body:
                self._gap += text
                return
            text, self._gap = self._gap + body, text[len(body) :]
        self._out.append(ContentDelta(text))

    def open_call(self, name: str) -> int:
        """Start a call: its index, or UNKNOWN / DROPPED (then nothing is emitted)."""
        if self._names is not None and name not in self._names:
            return UNKNOWN
        if not self._parallel and self.calls:
            self.dropped += 1
            return DROPPED
        if self._index >= 0:
            self.close_call()
        index = self.calls
        self.calls += 1
        self._index = index
        self._pieces = []
        self._out.append(ToolCallDelta(index, "", self._new_id(), name))
        return index

    def args(self, piece: str) -> None:
        """An argument fragment of the open call (ignored when none is open)."""
        if piece and self._index >= 0:
            self._pieces.append(piece)
            self._out.append(ToolCallDelta(self._index, piece))

    def close_call(self) -> None:
        """Close the open call, recording an error if its arguments are not a JSON object."""
        index = self._index
        if index < 0:
            return
        self._index = -1
        text = "".join(self._pieces)
        self._pieces = []
        try:
            value = json.loads(text)
        except ValueError as exc:
            self.errors.append(ToolCallFailure(index, f"arguments are not valid JSON: {exc}"))
            return
        if not isinstance(value, dict):
            self.errors.append(ToolCallFailure(index, "arguments are not a JSON object"))

    def fail(self, message: str) -> None:
        """Close the open call as malformed (its fragments stay as streamed)."""
        if self._index >= 0:
            self.errors.append(ToolCallFailure(self._index, message))
            self._index = -1
            self._pieces = []

    def pass_mode(self) -> None:
        self._mode = PASS

    def text_mode(self, tag: str) -> None:
        self._mode = TEXT
        self._tag = tag

    def json_mode(self, sink: int, depth: int = 0) -> None:
        self._mode = JSON
        self._sink = sink
        self._depth = depth
        self._in_str = self._esc = self._prim = False
        self.scan_failed = False

    def until_mode(self, tag: str, sink: int) -> None:
        self._mode = UNTIL
        self._tag = tag
        self._sink = sink

    def string_mode(self, terminator: str, close: str, strip_newline: bool) -> None:
        self._mode = STRING
        self._tag = terminator
        self._close = close
        self._strip_nl = strip_newline

    def take_captured(self) -> str:
        text = "".join(self._captured)
        self._captured = []
        return text

    # -- hot loops --------------------------------------------------------------
    def _sink_text(self, piece: str) -> None:
        if not piece:
            return
        sink = self._sink
        if sink == EMIT:
            self.args(piece)
        elif sink == CAPTURE:
            self._captured.append(piece)

    def _scan_text(self, text: str) -> str:
        tag = self._tag
        i = text.find(tag)
        if i >= 0:
            if i:
                self.content(text[:i])
            self._gap = ""
            self._mode = COLD
            return text[i:]
        keep = partial(text, tag)
        if keep:
            self._buf = text[len(text) - keep :]
            text = text[: len(text) - keep]
        if text:
            self.content(text)
        return ""

    def _scan_until(self, text: str) -> str:
        tag = self._tag
        i = text.find(tag)
        if i >= 0:
            self._sink_text(text[:i])
            self._mode = COLD
            return text[i + len(tag) :]
        keep = partial(text, tag)
        if keep:
            self._buf = text[len(text) - keep :]
            text = text[: len(text) - keep]
        self._sink_text(text)
        return ""

    def _scan_string(self, text: str) -> str:
        tag = self._tag
        i = text.find(tag)
        if i >= 0:
            value = text[:i]
            if self._strip_nl and value.endswith("\n"):
                value = value[:-1]
            self.args(encode_basestring(value)[1:-1] + self._close)
            self._mode = COLD
            return text[i + len(tag) :]
        cut = len(text) - partial(text, tag)
        if self._strip_nl and cut > 0 and text[cut - 1] == "\n":
            cut -= 1
        if cut < len(text):
            self._buf = text[cut:]
        if cut:
            self.args(encode_basestring(text[:cut])[1:-1])
        return ""

    def _scan_json(self, text: str) -> str:
        depth = self._depth
        in_str = self._in_str
        esc = self._esc
        prim = self._prim
        n = len(text)
        end = -1
        bad = False
        i = 0
        while i < n:
            c = text[i]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
                    if depth == 0:
                        end = i + 1
                        break
            elif c == '"':
                if prim:
                    bad = True
                    break
                in_str = True
            elif c == "{" or c == "[":
                if prim:
                    bad = True
                    break
                depth += 1
            elif c == "}" or c == "]":
                if depth == 0:
                    bad = not prim
                    end = i
                    break
                depth -= 1
                if depth == 0:
                    end = i + 1
                    break
            elif c == ",":
                if depth == 0:
                    bad = not prim
                    end = i
                    break
            elif c in _WS:
                if depth == 0 and prim:
                    end = i
                    break
            elif c == ":":
                if depth == 0:
                    bad = True
                    break
            elif c in _LITERAL:
                if depth == 0:
                    prim = True
            else:
                bad = True
                break
            i += 1
        if bad:
            end = i
            self.scan_failed = True
        self._depth, self._in_str, self._esc, self._prim = depth, in_str, esc, prim
        if end < 0:
            self._sink_text(text)
            return ""
        self._sink_text(text[:end])
        self._mode = COLD
        return text[end:]
