"""Mistral tool calls after ``[TOOL_CALLS]``, in both of its forms.

* list form: ``[TOOL_CALLS][{"name": …, "arguments": …}, …]`` (a bare
  object without the list is accepted too);
* header form: ``[TOOL_CALLS]name[ARGS]{…}``, optionally
  ``name[CALL_ID]id[ARGS]{…}``; calls repeat with or without a new
  ``[TOOL_CALLS]``.  The model's own call id is ignored (ids are ours).

Documented behaviour: Mistral has no end tag, so a call ends where its JSON
ends; text after the calls is content and a later ``[TOOL_CALLS]`` starts
new calls.  A ``[TOOL_CALLS]`` not followed by a call (or naming a tool not
in the request's list) is returned verbatim as content.  Malformed JSON in
streamed arguments closes the call with an error in ``tracker.errors`` and
the rest is content.  Arguments written as a JSON string are unwrapped.
"""

from __future__ import annotations

from .base import (
    CAPTURE,
    DROP,
    EMIT,
    HEADER_LIMIT,
    UNKNOWN,
    JSONCallFormat,
    Tracker,
    skip_ws,
)

__all__ = ["ARGS", "CALL_ID", "START", "MistralFormat"]

START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"

(_TEXT, _OPEN, _LIST, _OBJ, _LIST_SEP, _NAME, _CALL_ID, _ARGS_START, _HARGS, _HARGVAL,
 _AFTER) = range(11)


def _ident(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "_-.")


class MistralFormat(JSONCallFormat):
    name = "mistral"

    def __init__(self) -> None:
        super().__init__()
        self.phase = _TEXT
        self.call_name = ""

    def start(self, t: Tracker) -> None:
        self.content_mode(t)

    def content_mode(self, t: Tracker) -> None:
        self.phase = _TEXT
        t.text_mode(START)

    def object_done(self, t: Tracker) -> None:
        self.phase = _LIST_SEP if self.listed else _AFTER

    def step(self, t: Tracker, buf: str) -> int:
        ph = self.phase
        if ph == _OBJ:
            return self.object_step(t, buf)
        if ph == _TEXT:
            self.raw = START
            self.phase = _OPEN
            return len(START)
        if ph == _HARGS or ph == _HARGVAL:
            return self._args_done(t, ph)
        if ph == _NAME:
            return self._name(t, buf)
        if ph == _CALL_ID:
            i = buf.find(ARGS, 0, HEADER_LIMIT)
            if i < 0:
                if len(buf) >= HEADER_LIMIT:
                    self.verbatim(t)
                    return 0
                return -1
            self.raw += buf[: i + len(ARGS)]
            self.phase = _ARGS_START
            return i + len(ARGS)
        if ph == _AFTER:
            if _ident(buf[0]):
                self.raw = ""
                self.phase = _NAME
            else:
                self.content_mode(t)
            return 0
        i = skip_ws(buf, 0)
        if i == len(buf):
            if ph != _LIST_SEP:
                self.raw += buf
            return i
        c = buf[i]
        if ph == _LIST_SEP:
            if c == ",":
                self.phase = _LIST
                return i + 1
            if c == "]":
                self.phase = _AFTER
                return i + 1
            self.content_mode(t)
            return i
        if ph == _ARGS_START:
            return self._open(t, buf, i)
        if ph == _OPEN:
            if c == "[":
                self.raw += buf[: i + 1]
                self.phase = _LIST
                return i + 1
            if c == "{":
                self.listed = False
                self.begin_object(self.raw + buf[:i])
                self.phase = _OBJ
                return i
            if _ident(c):
                self.raw += buf[:i]
                self.phase = _NAME
                return i
        elif ph == _LIST:
            if c == "{":
                self.listed = True
                self.begin_object(self.raw + buf[:i])
                self.phase = _OBJ
                return i
            if c == "]":
                if self.raw:  # an empty list is not a call
                    self.verbatim(t, buf[: i + 1])
                    return i + 1
                self.phase = _AFTER
                return i + 1
        self.verbatim(t)
        return 0

    def _name(self, t: Tracker, buf: str) -> int:
        j, n = 0, len(buf)
        while j < n and j <= HEADER_LIMIT and _ident(buf[j]):
            j += 1
        if j > HEADER_LIMIT:
            self.verbatim(t)
            return 0
        if j == n:
            return -1
        rest = buf[j:]
        for tag, phase in ((ARGS, _ARGS_START), (CALL_ID, _CALL_ID)):
            if rest.startswith(tag):
                if j == 0:
                    break
                self.call_name = buf[:j]
                self.raw += buf[: j + len(tag)]
                self.phase = phase
                return j + len(tag)
            if tag.startswith(rest):
                return -1
        self.verbatim(t)
        return 0

    def _open(self, t: Tracker, buf: str, i: int) -> int:
        idx = t.open_call(self.call_name)
        if idx == UNKNOWN:
            self.verbatim(t, buf[:i])
            return i
        self.raw = ""
        self.accepted = idx >= 0
        if buf[i] in "{[":
            self.phase = _HARGS
            t.json_mode(EMIT if self.accepted else DROP)
        else:
            self.phase = _HARGVAL
            t.json_mode(CAPTURE)
        return i

    def _args_done(self, t: Tracker, ph: int) -> int:
        if not self.arguments_closed(t, captured=ph == _HARGVAL):
            self.content_mode(t)
            return 0
        if self.accepted:
            t.close_call()
        self.accepted = False
        self.phase = _AFTER
        return 0

    def finish(self, t: Tracker, pending: str) -> None:
        ph = self.phase
        if ph == _OBJ:
            self.object_finish(t, pending)
        elif ph == _HARGS or ph == _HARGVAL:  # the arguments scan was cut off
            if self.accepted:
                t.fail("tool call arguments not finished at end of stream")
        elif ph == _AFTER or ph == _LIST_SEP:
            if ph == _AFTER:
                t.content(pending)
        else:
            t.content(self.raw + pending)
        self.raw = ""
