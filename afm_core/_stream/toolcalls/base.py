"""What every tool-call wire format shares (pure, cold path).

A format is a small object driven by the tracker (``afm_core._stream.tools``): the
tracker runs the hot loops (content outside calls, JSON argument values,
streamed string values) and calls the format's ``step`` only at the
boundaries, with the text it has not consumed.  ``step`` returns how many
characters it consumed (0: it progressed without consuming; -1: it needs more
text) and switches the tracker's mode through its methods.

``JSONCallFormat`` is the shared machine for a call written as one JSON
object ``{"name": ..., "arguments" | "parameters": ...}`` (Hermes, Llama-3,
Mistral's list form): the arguments value streams raw as the model writes it
when ``name`` comes first; otherwise the object is captured whole (linear, in
the tracker) and the raw text of its arguments member is emitted at once.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

from ..text import partial_tag as partial

__all__ = [
    "CAPTURE",
    "DROP",
    "DROPPED",
    "EMIT",
    "UNKNOWN",
    "JSONCallFormat",
    "ToolCallFailure",
    "ToolFormat",
    "new_call_id",
    "partial",
    "tool_names",
]

# Sinks for the tracker's JSON / UNTIL modes (the C twin mirrors the values).
EMIT = 0  # argument fragments of the open call
CAPTURE = 1  # collected; ``take_captured()`` returns it
DROP = 2  # discarded

# ``open_call`` refusals.
UNKNOWN = -1  # the name is not in the request's tool list
DROPPED = -2  # parallel_tool_calls=false and a call was already made

# Headers are decided on at most this many characters (so never by chunking).
HEADER_LIMIT = 512


@dataclass(frozen=True, slots=True)
class ToolCallFailure:
    """A call that started streaming but ended malformed (``index``), or a note.

    A record in ``tracker.errors``, not an exception.  ``ToolCallError`` (also
    ``afm_core.ToolCallError``) is its former name, kept as an alias of this class.
    """

    index: int | None
    message: str


ToolCallError = ToolCallFailure  # the former name (public as afm_core.ToolCallError)


def new_call_id() -> str:
    """``call_`` and 24 random hex digits."""
    return f"call_{secrets.token_hex(12)}"


def tool_names(tools: Any) -> frozenset[str] | None:
    """Names in an OpenAI ``tools`` list (None when no list was given)."""
    if not tools:
        return None
    names = set()
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


class Tracker(Protocol):
    """The tracker methods a format may call (both twins provide them)."""

    scan_failed: bool

    def content(self, text: str) -> None: ...
    def open_call(self, name: str) -> int: ...
    def args(self, piece: str) -> None: ...
    def close_call(self) -> None: ...
    def fail(self, message: str) -> None: ...
    def pass_mode(self) -> None: ...
    def text_mode(self, tag: str) -> None: ...
    def json_mode(self, sink: int, depth: int = 0) -> None: ...
    def until_mode(self, tag: str, sink: int) -> None: ...
    def string_mode(self, terminator: str, close: str, strip_newline: bool) -> None: ...
    def take_captured(self) -> str: ...


class ToolFormat:
    """Base of the per-format state machines (one instance per stream)."""

    name = ""

    def start(self, t: Tracker) -> None:
        """Set the tracker's initial mode."""
        raise NotImplementedError

    def step(self, t: Tracker, buf: str) -> int:
        """Consume a prefix of ``buf``; ``-1`` when it needs more text.

        ``buf`` is empty only right after a scan ended with the text.
        """
        raise NotImplementedError

    def finish(self, t: Tracker, pending: str) -> None:
        """End of stream; ``pending`` is unconsumed or captured text."""
        raise NotImplementedError


# -- JSON call objects -----------------------------------------------------------

NEED = -1
OTHER = -2
_WS = " \t\r\n"
_ARG_KEYS = ('"arguments"', '"parameters"')


def skip_ws(buf: str, i: int) -> int:
    n = len(buf)
    while i < n and buf[i] in _WS:
        i += 1
    return i


def _literal(buf: str, i: int, options: tuple[str, ...]) -> int:
    """Position after one of ``options`` at ``i``; NEED if a prefix; OTHER."""
    rest = buf[i:]
    for lit in options:
        if rest.startswith(lit):
            return i + len(lit)
    for lit in options:
        if lit.startswith(rest):
            return NEED
    return OTHER


def object_header(buf: str, i: int) -> tuple[int, str]:
    """Parse ``{"name": "N", "arguments": `` at ``buf[i]`` (a ``{``).

    ``(pos, name)`` with ``pos`` at the arguments value's first character,
    ``(NEED, "")`` when more text is needed, ``(OTHER, "")`` otherwise.
    """
    i = skip_ws(buf, i + 1)
    for step in ('"name"', ":", "STRING", ",", "ARGKEY", ":"):
        if step == "STRING":
            if i >= len(buf):
                return NEED, ""
            if buf[i] != '"':
                return OTHER, ""
            j, esc = i + 1, False
            while j < len(buf):
                c = buf[j]
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    break
                j += 1
            else:
                return NEED, ""
            try:
                name = json.loads(buf[i : j + 1])
            except ValueError:
                return OTHER, ""
            i = j + 1
        else:
            i = _literal(buf, i, _ARG_KEYS if step == "ARGKEY" else (step,))
            if i < 0:
                return i, ""
        i = skip_ws(buf, i)
    if i >= len(buf):
        return NEED, ""
    return i, name


def object_members(text: str) -> dict[str, str]:
    """Top-level members of a JSON object as raw value text (ValueError if not one)."""
    dec = json.JSONDecoder()
    i = skip_ws(text, 0)
    if text[i : i + 1] != "{":
        raise ValueError("not an object")
    i = skip_ws(text, i + 1)
    out: dict[str, str] = {}
    if text[i : i + 1] == "}":
        return out
    while True:
        key, i = dec.raw_decode(text, i)
        i = skip_ws(text, i)
        if not isinstance(key, str) or text[i : i + 1] != ":":
            raise ValueError("bad member")
        start = skip_ws(text, i + 1)
        _, i = dec.raw_decode(text, start)
        out[key] = text[start:i]
        i = skip_ws(text, i)
        if text[i : i + 1] == "}":
            return out
        if text[i : i + 1] != ",":
            raise ValueError("bad separator")
        i = skip_ws(text, i + 1)


def arguments_text(raw: str) -> str:
    """The argument JSON for a raw ``arguments`` value: a JSON string is unwrapped."""
    value = json.loads(raw)
    if isinstance(value, str):
        return value
    if value is None:
        return "{}"
    return raw


# Phases of a JSON call object.
O_IDLE, O_HEAD, O_ARGS, O_ARGVAL, O_TAIL, O_WHOLE = range(6)


class JSONCallFormat(ToolFormat):
    """A call object ``{"name":…, "arguments":…}``; subclasses frame it.

    Subclass hooks: ``object_done(t)`` after the object closed (the tracker
    is in COLD mode), ``content_mode(t)`` to fall back to plain content.
    ``raw`` holds the consumed text of a call not yet accepted, so a call
    that turns out malformed or unknown is returned verbatim as content.
    """

    def __init__(self) -> None:
        self.raw = ""
        self.obj = O_IDLE
        self.accepted = False

    # -- hooks --------------------------------------------------------------
    def object_done(self, t: Tracker) -> None:
        raise NotImplementedError

    def content_mode(self, t: Tracker) -> None:
        raise NotImplementedError

    def abandon(self, t: Tracker) -> None:
        """After malformed JSON inside an accepted call (default: content)."""
        self.content_mode(t)

    # -- machine ------------------------------------------------------------
    def begin_object(self, raw: str) -> None:
        """The next step's ``buf`` starts at the object's ``{``."""
        self.raw = raw
        self.obj = O_HEAD

    def arguments_closed(self, t: Tracker, *, captured: bool) -> bool:
        """The arguments value ended: emit it if it was ``captured`` (a scalar
        or unwrapped string).  False when the scan failed: the call is
        reported malformed (if accepted) and no longer accepted."""
        if captured:
            raw = t.take_captured()
            if self.accepted and not t.scan_failed:
                try:
                    t.args(arguments_text(raw))
                except ValueError:
                    t.args(raw)
        if t.scan_failed:
            if self.accepted:
                t.fail("malformed tool call arguments")
            self.accepted = False
            return False
        return True

    def verbatim(self, t: Tracker, text: str = "") -> None:
        """Give up on the call: what was consumed goes out as content."""
        t.content(self.raw + text)
        self.raw = ""
        self.obj = O_IDLE
        self.content_mode(t)

    def object_step(self, t: Tracker, buf: str) -> int:
        ph = self.obj
        if ph == O_HEAD:
            pos, name = object_header(buf[:HEADER_LIMIT], 0)
            if pos == NEED and len(buf) < HEADER_LIMIT:
                return -1
            if pos < 0:  # name not first (or no arguments key): capture it whole
                self.obj = O_WHOLE
                t.json_mode(CAPTURE)
                return 0
            idx = t.open_call(name)
            if idx == UNKNOWN:
                self.verbatim(t, buf[:pos])
                return pos
            self.accepted = idx >= 0
            self.raw = ""
            c = buf[pos]
            if c == "{" or c == "[":
                self.obj = O_ARGS
                t.json_mode(EMIT if self.accepted else DROP)
            else:  # a JSON string (unwrapped) or another scalar
                self.obj = O_ARGVAL
                t.json_mode(CAPTURE)
            return pos
        if ph == O_ARGS or ph == O_ARGVAL:
            if not self.arguments_closed(t, captured=ph == O_ARGVAL):
                self.obj = O_IDLE
                self.abandon(t)
                return 0
            self.obj = O_TAIL
            t.json_mode(DROP, 1)
            return 0
        if ph == O_TAIL:
            if self.accepted:
                t.close_call()
            self.accepted = False
            self.obj = O_IDLE
            if t.scan_failed:
                self.abandon(t)
            else:
                self.object_done(t)
            return 0
        if ph == O_WHOLE:
            text = t.take_captured()
            if t.scan_failed:
                self.verbatim(t, text)
                return 0
            try:
                members = object_members(text)
                call_name = json.loads(members["name"])
                raw_args = members.get("arguments", members.get("parameters", "{}"))
                args = arguments_text(raw_args)
            except (ValueError, KeyError):
                call_name = None
            if not isinstance(call_name, str):
                self.verbatim(t, text)
                return 0
            idx = t.open_call(call_name)
            if idx == UNKNOWN:
                self.verbatim(t, text)
                return 0
            if idx >= 0:
                t.args(args)
                t.close_call()
            self.raw = ""
            self.obj = O_IDLE
            self.object_done(t)
            return 0
        raise AssertionError(f"object_step in phase {ph}")

    def object_finish(self, t: Tracker, pending: str) -> None:
        """End of stream inside a call object."""
        ph = self.obj
        if ph in (O_HEAD, O_WHOLE):
            t.content(self.raw + pending)
        elif ph in (O_ARGS, O_ARGVAL) and self.accepted:
            t.fail("tool call arguments not finished at end of stream")
        elif ph == O_TAIL and self.accepted:
            t.close_call()
        self.raw = ""
        self.obj = O_IDLE
        self.accepted = False
