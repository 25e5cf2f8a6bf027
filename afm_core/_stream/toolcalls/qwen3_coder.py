"""Qwen3-Coder XML tool calls, turned into JSON arguments as they stream.

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

Values are typed from the tool's JSON schema (``properties[P].type``):
integer / number / boolean / object / array / null, else string; one
newline after ``<parameter=P>`` and one before ``</parameter>`` are not part
of the value (as in mlx-lm's parser).  The arguments are JSON we write, equal
to ``json.dumps(arguments, ensure_ascii=False)``: ``{"P": `` goes out when
the parameter opens, a string value streams escaped as it arrives (only a
possible ``null`` or closing tag is held back), other values go out when
their ``</parameter>`` arrives, ``}`` at ``</function>``.

Documented behaviour: a value that does not convert to its schema type is a
string; ``null`` (any case) is ``null``; a parameter not in the schema is a
string; a block without ``<function=NAME>`` or naming a tool not in the
request's list is content verbatim; text between parameters is dropped; an
unclosed function at the end of the stream gets its JSON closed and an error
in ``tracker.errors``.  ``</tool_call>`` is optional after ``</function>``
and several functions may share one block.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from .base import (
    CAPTURE,
    DROP,
    HEADER_LIMIT,
    UNKNOWN,
    ToolFormat,
    Tracker,
    skip_ws,
)

__all__ = ["END", "START", "Qwen3CoderFormat", "convert_value"]

START, END = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_NULLS = ("null\n" + PARAM_END, "null" + PARAM_END)

_TEXT, _OPEN, _FUNC, _PARAMS, _VALUE, _VALUE2, _STR, _CAP, _DROP, _AFTER = range(10)


def _type_of(schema: Any) -> str | None:
    if not isinstance(schema, dict) or "type" not in schema:
        return None
    t = schema["type"]
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), "null")
    return str(t).strip().lower()


def convert_value(value: str, schema: Any, known: bool) -> Any:
    """The JSON value of a parameter's text, typed from its schema."""
    if value.lower() == "null":
        return None
    if not known:
        return value
    ptype = _type_of(schema)
    if ptype is None or ptype not in _STRING_TYPES:
        try:
            if ptype is None:
                parsed = json.loads(value)
                return parsed if isinstance(parsed, (dict, list)) else value
            if ptype.startswith(("int", "uint", "long", "short", "unsigned")):
                f = float(value)
                if not math.isfinite(f) or f != int(f):
                    return value
                return int(f)
            if ptype.startswith(("num", "float", "double")):
                f = float(value)
                if not math.isfinite(f):
                    return value
                return int(f) if f == int(f) else f
            if ptype in ("boolean", "bool", "binary"):
                low = value.strip().lower()
                return low == "true" if low in ("true", "false") else value
            try:
                return json.loads(value, strict=False)
            except ValueError:
                lit = ast.literal_eval(value)
                json.dumps(lit, allow_nan=False)
                return lit
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return value
    return value


def _schemas(tools: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class Qwen3CoderFormat(ToolFormat):
    name = "qwen3_coder"

    def __init__(self, tools: Any = None) -> None:
        self.schemas = _schemas(tools)
        self.phase = _TEXT
        self.raw = ""
        self.props: dict[str, Any] = {}
        self.nparams = 0
        self.param = ""

    def start(self, t: Tracker) -> None:
        self._text(t)

    def _text(self, t: Tracker) -> None:
        self.phase = _TEXT
        self.raw = ""
        t.text_mode(START)

    def _verbatim(self, t: Tracker, text: str = "") -> None:
        t.content(self.raw + text)
        self._text(t)

    def _key(self, name: str) -> str:
        sep = "{" if self.nparams == 0 else ", "
        self.nparams += 1
        return sep + _dump(name) + ": "

    def _close(self, t: Tracker) -> None:
        t.args("}" if self.nparams else "{}")

    def _typed(self, t: Tracker, value: str) -> None:
        if value.endswith("\n"):
            value = value[:-1]
        known = self.param in self.props
        t.args(self._key(self.param) + _dump(convert_value(value, self.props.get(self.param), known)))

    def _streams(self) -> bool:
        """Whether the current parameter's value streams as a JSON string."""
        if self.param not in self.props:
            return True
        ptype = _type_of(self.props[self.param])
        return ptype is not None and ptype in _STRING_TYPES

    def step(self, t: Tracker, buf: str) -> int:
        ph = self.phase
        if ph == _TEXT:
            self.raw = START
            self.phase = _OPEN
            return len(START)
        if ph == _STR:
            self.phase = _PARAMS
            return 0
        if ph == _CAP:
            self.phase = _PARAMS
            self._typed(t, t.take_captured())
            return 0
        if ph == _DROP:
            self.phase = _AFTER
            return 0
        if ph == _VALUE:
            self.phase = _VALUE2
            return 1 if buf[0] == "\n" else 0
        if ph == _VALUE2:
            return self._value(t, buf)
        i = skip_ws(buf, 0)
        if i == len(buf):
            if ph == _OPEN:
                self.raw += buf
            return i
        rest = buf[i:]
        if ph == _OPEN or ph == _FUNC:
            return self._function(t, buf, i)
        if ph == _AFTER:
            if rest.startswith(END):
                self._text(t)
                return i + len(END)
            if rest.startswith(FUNC):
                self.phase = _FUNC
                return i
            if END.startswith(rest) or FUNC.startswith(rest):
                return -1
            self._text(t)
            return i
        # _PARAMS
        if rest.startswith(PARAM):
            j = rest.find(">", 0, HEADER_LIMIT)
            if j < 0:
                return -1 if len(rest) < HEADER_LIMIT else i + 1
            self.param = rest[len(PARAM) : j].strip()
            self.phase = _VALUE
            return i + j + 1
        for tag in (FUNC_END, END):
            if rest.startswith(tag):
                self._close(t)
                t.close_call()
                if tag == END:
                    self._text(t)
                else:
                    self.phase = _AFTER
                return i + len(tag)
        if PARAM.startswith(rest) or FUNC_END.startswith(rest) or END.startswith(rest):
            return -1
        j = rest.find("<", 1)
        return i + (j if j > 0 else len(rest))  # stray text between parameters

    def _function(self, t: Tracker, buf: str, i: int) -> int:
        rest = buf[i:]
        if not rest.startswith(FUNC):
            if FUNC.startswith(rest):
                return -1
            if self.phase == _OPEN:
                self._verbatim(t)
                return 0
            self._text(t)
            return 0
        j = rest.find(">", 0, HEADER_LIMIT)
        if j < 0 and len(rest) < HEADER_LIMIT and "<" not in rest[len(FUNC) :]:
            return -1
        name = rest[len(FUNC) : j].strip() if j > 0 else ""
        if not name or "<" in name or "\n" in name:
            self._verbatim(t)
            return 0
        idx = t.open_call(name)
        if idx == UNKNOWN:
            self._verbatim(t, buf[: i + j + 1])
            return i + j + 1
        self.raw = ""
        if idx < 0:
            self.phase = _DROP
            t.until_mode(FUNC_END, DROP)
            return i + j + 1
        self.props = self.schemas.get(name, {})
        self.nparams = 0
        self.phase = _PARAMS
        return i + j + 1

    def _value(self, t: Tracker, buf: str) -> int:
        if not self._streams():
            self.phase = _CAP
            t.until_mode(PARAM_END, CAPTURE)
            return 0
        end = buf.find(PARAM_END)
        if end >= 0:
            self._typed(t, buf[:end])
            self.phase = _PARAMS
            return end + len(PARAM_END)
        low = buf.lower()
        if any(n.startswith(low) for n in _NULLS):
            return -1
        t.args(self._key(self.param) + '"')
        self.phase = _STR
        t.string_mode(PARAM_END, '"', True)
        return 0

    def finish(self, t: Tracker, pending: str) -> None:
        ph = self.phase
        if ph in (_OPEN, _FUNC) and self.raw:
            t.content(self.raw + pending)
        elif ph in (_PARAMS, _VALUE, _VALUE2, _STR, _CAP):
            if ph in (_VALUE, _VALUE2, _CAP):
                self._typed(t, pending)
            self._close(t)
            t.fail("tool call not closed before the end of the stream")
        self.raw = ""
        self.phase = _TEXT
