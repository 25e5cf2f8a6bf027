"""Hermes / Qwen JSON tool calls: ``<tool_call>{"name": …, "arguments": …}</tool_call>``.

Documented behaviour:

* the arguments value streams raw as the model writes it when ``name`` comes
  first; otherwise (arguments first, extra keys first) the object is
  captured whole and its raw ``arguments`` text is emitted at once;
  ``"parameters"`` is accepted for ``"arguments"``; arguments given as a
  JSON string are unwrapped (the string is the argument JSON);
* anything after the object up to ``</tool_call>`` is dropped; a missing
  ``</tool_call>`` at the end of the stream is tolerated;
* an output that starts (after whitespace) with a fenced JSON block holding a
  call object, ````` ```json\n{"name": …, "arguments": …}\n``` `````, is a call
  too, as llama.cpp's Hermes parser reads it (Qwen2.5-Coder answers a tool
  request that way); the text up to the closing fence is dropped;
* a call that is not a JSON call object (or names a tool not in the
  request's list) is returned verbatim as content, tags included;
* malformed JSON inside arguments that already streamed closes the call with
  an error in ``tracker.errors``; the rest of the call is dropped.
"""

from __future__ import annotations

from .base import DROP, HEADER_LIMIT, JSONCallFormat, Tracker, skip_ws

__all__ = ["END", "START", "HermesFormat"]

START, END = "<tool_call>", "</tool_call>"
FENCE = "```"
"""A fenced call at the start of the output: FENCE, ``json`` or nothing, a newline, ``{``."""

_TEXT, _OPEN, _OBJ, _END, _START = range(5)


class HermesFormat(JSONCallFormat):
    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self.phase = _TEXT
        self.fenced = False

    def start(self, t: Tracker) -> None:
        self.phase = _START  # the tracker starts in COLD mode: look for a fenced call first

    def content_mode(self, t: Tracker) -> None:
        self.phase = _TEXT
        t.text_mode(START)

    def abandon(self, t: Tracker) -> None:
        self.object_done(t)

    def object_done(self, t: Tracker) -> None:
        self.phase = _END
        t.until_mode(FENCE if self.fenced else END, DROP)
        self.fenced = False

    def step(self, t: Tracker, buf: str) -> int:
        ph = self.phase
        if ph == _OBJ:
            return self.object_step(t, buf)
        if ph == _START:
            return self._fence_step(t, buf)
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

    def _fence_step(self, t: Tracker, buf: str) -> int:
        """At the start of the output: a fenced call object, or content from the first character."""
        i = skip_ws(buf, 0)
        rest = buf[i:]
        if not rest:
            return -1  # whitespace so far
        if not rest.startswith(FENCE):
            return -1 if FENCE.startswith(rest) else self._no_fence(t)
        j = len(FENCE)
        if rest[j : j + 4] == "json":
            j += 4
        elif len(rest) < j + 4 and "json".startswith(rest[j:]):
            return -1  # (a part of "json" so far)
        if j == len(rest):
            return -1
        if rest[j] != "\n":
            return self._no_fence(t)
        k = skip_ws(rest, j + 1)
        if k == len(rest):
            return -1 if len(rest) < HEADER_LIMIT else self._no_fence(t)
        if rest[k] != "{":
            return self._no_fence(t)
        self.fenced = True
        self.begin_object(buf[: i + k])
        self.phase = _OBJ
        return i + k

    def _no_fence(self, t: Tracker) -> int:
        self.content_mode(t)  # the text is scanned again from its first character
        return 0

    def finish(self, t: Tracker, pending: str) -> None:
        ph = self.phase
        if ph == _OBJ:
            self.object_finish(t, pending)
        elif ph == _OPEN or ph == _TEXT or ph == _START:
            t.content(self.raw + pending)
        self.raw = ""
        self.fenced = False
