"""Hermes / Qwen JSON tool calls: ``<tool_call>{"name": …, "arguments": …}</tool_call>``.

Documented behaviour:

* the arguments value streams raw as the model writes it when ``name`` comes
  first; otherwise (arguments first, extra keys first) the object is
  captured whole and its raw ``arguments`` text is emitted at once;
  ``"parameters"`` is accepted for ``"arguments"``; arguments given as a
  JSON string are unwrapped (the string is the argument JSON);
* anything after the object up to ``</tool_call>`` is dropped; a missing
  ``</tool_call>`` at the end of the stream is tolerated;
* a call that is not a JSON call object (or names a tool not in the
  request's list) is returned verbatim as content, tags included;
* malformed JSON inside arguments that already streamed closes the call with
  an error in ``tracker.errors``; the rest of the call is dropped.
"""

from __future__ import annotations

from .base import DROP, JSONCallFormat, Tracker, skip_ws

__all__ = ["END", "START", "HermesFormat"]

START, END = "<tool_call>", "</tool_call>"

_TEXT, _OPEN, _OBJ, _END = range(4)


class HermesFormat(JSONCallFormat):
    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self.phase = _TEXT

    def start(self, t: Tracker) -> None:
        self.content_mode(t)

    def content_mode(self, t: Tracker) -> None:
        self.phase = _TEXT
        t.text_mode(START)

    def abandon(self, t: Tracker) -> None:
        self.object_done(t)

    def object_done(self, t: Tracker) -> None:
        self.phase = _END
        t.until_mode(END, DROP)

    def step(self, t: Tracker, buf: str) -> int:
        ph = self.phase
        if ph == _OBJ:
            return self.object_step(t, buf)
        if ph == _TEXT:  # the text mode stopped at the start tag
            self.raw = START
            self.phase = _OPEN
            return len(START)
        if ph == _OPEN:
            i = skip_ws(buf, 0)
            if i == len(buf):
                self.raw += buf
                return i
            if buf[i] != "{":
                self.verbatim(t)
                return 0
            self.begin_object(self.raw + buf[:i])
            self.phase = _OBJ
            return i
        # _END: the closing tag was found
        self.content_mode(t)
        return 0

    def finish(self, t: Tracker, pending: str) -> None:
        ph = self.phase
        if ph == _OBJ:
            self.object_finish(t, pending)
        elif ph == _OPEN or ph == _TEXT:
            t.content(self.raw + pending)
        self.raw = ""
