"""Llama-3 JSON tool calls: ``{"name": …, "parameters": …}`` at the start of the output.

Optionally after ``<|python_tag|>``; several calls may follow each other,
separated by ``;`` and/or whitespace.  Documented behaviour:

* only an output that starts (after whitespace) with ``{`` or the python tag
  is a call; any other output is plain content from the first character
  (held leading whitespace included), as in vLLM's ``llama3_json`` parser;
* a first object that is not a call (no string ``name``, unknown tool) is
  content verbatim, and so is everything after it;
* text after the last call that is not another call object is content;
  separators and whitespace between or after calls are dropped;
* malformed JSON inside streamed arguments closes the call with an error in
  ``tracker.errors``; the rest of the output is content.
"""

from __future__ import annotations

from .base import JSONCallFormat, Tracker

__all__ = ["PYTHON_TAG", "Llama3JSONFormat"]

PYTHON_TAG = "<|python_tag|>"

_START, _TAGGED, _OBJ, _AFTER = range(4)
_SEP = " \t\r\n;"


class Llama3JSONFormat(JSONCallFormat):
    name = "llama3_json"

    def __init__(self) -> None:
        super().__init__()
        self.phase = _START

    def start(self, t: Tracker) -> None:
        self.phase = _START  # the tracker starts in COLD mode

    def content_mode(self, t: Tracker) -> None:
        t.pass_mode()

    def object_done(self, t: Tracker) -> None:
        self.phase = _AFTER

    def step(self, t: Tracker, buf: str) -> int:
        ph = self.phase
        if ph == _OBJ:
            return self.object_step(t, buf)
        i, n = 0, len(buf)
        seps = _SEP if ph == _AFTER else " \t\r\n"
        while i < n and buf[i] in seps:
            i += 1
        if i == n:
            self.raw += buf
            return n
        rest = buf[i:]
        if ph == _START:
            if rest.startswith(PYTHON_TAG):
                self.raw += buf[: i + len(PYTHON_TAG)]
                self.phase = _TAGGED
                return i + len(PYTHON_TAG)
            if PYTHON_TAG.startswith(rest):
                return -1
        if rest[0] == "{":
            self.begin_object("" if ph == _AFTER else self.raw + buf[:i])
            self.phase = _OBJ
            return i
        if ph == _AFTER:  # trailing content starts at its first non-separator
            self.raw = ""
            t.pass_mode()
            return i
        self.verbatim(t)
        return 0

    def finish(self, t: Tracker, pending: str) -> None:
        if self.phase == _OBJ:
            self.object_finish(t, pending)
        elif self.phase != _AFTER:
            t.content(self.raw + pending)
        self.raw = ""
