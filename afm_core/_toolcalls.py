"""Hermes/Qwen tool calls streamed as OpenAI ``tool_calls`` fragments (sans-IO).

Model text in, events out: ``ContentDelta`` outside calls and
``ToolCallDelta`` fragments inside ``<tool_call>{"name": …, "arguments": …}</tool_call>``.
The first fragment of a call carries ``index``, ``id`` and ``name``; later
ones carry only ``arguments`` pieces, streamed as the model writes them (an
incremental JSON scanner finds where the arguments value ends), so the
concatenated pieces are exactly the argument JSON the model wrote.

Rules (documented behaviour):
* a call whose JSON never yields a ``name`` before ``</tool_call>`` (or the
  end of the stream) is returned verbatim as content;
* a call naming a tool that is not in the request's list is content;
* ``parallel_tool_calls=False``: calls after the first are dropped;
* ``"arguments"`` given as a JSON string is unwrapped (the string is the
  argument JSON); a call with arguments before its name is parsed whole at
  ``</tool_call>``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any

from ._events import ContentDelta, ToolCallDelta

START, END = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')

_OUT, _HEAD, _ARGS, _TAIL, _VERBATIM, _DROP = range(6)


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class HermesToolParser:
    """Feed model text; ``flush()`` at the end; ``saw_tool_call`` after."""

    def __init__(self, tools: Any = None, *, parallel_tool_calls: bool = True,
                 id_factory: Callable[[], str] = new_call_id):
        self.names = {t["function"]["name"] for t in tools} if tools else None
        self.parallel = parallel_tool_calls
        self.new_id = id_factory
        self.index = -1
        self.saw_tool_call = False
        self._state = _OUT
        self._buf = ""

    # -- state helpers -------------------------------------------------------

    def _begin_call(self) -> None:
        self._state = _HEAD
        self._raw = START
        self._buf = ""
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._started = False
        self._string_value = False

    def feed(self, text: str) -> list[Any]:
        out: list[Any] = []
        self._buf += text
        while self._buf:
            before = (self._state, len(self._buf))
            self._advance(out)
            if (self._state, len(self._buf)) == before:
                break
        return out

    def _advance(self, out: list[Any]) -> None:
        st = self._state
        if st == _OUT:
            i = self._buf.find(START)
            if i >= 0:
                if i:
                    out.append(ContentDelta(self._buf[:i]))
                rest = self._buf[i + len(START):]
                if self.saw_tool_call and not self.parallel:
                    self._state, self._buf = _DROP, rest
                else:
                    self._begin_call()
                    self._buf = rest
                return
            hold = _partial(self._buf, START)
            emit = self._buf[: len(self._buf) - hold]
            if emit:
                out.append(ContentDelta(emit))
            self._buf = self._buf[len(emit):]
        elif st == _HEAD:
            m = _HEADER.match(self._buf)
            end = self._buf.find(END)
            if m and (end < 0 or m.end() <= end):
                name = json.loads(f'"{m.group(1)}"')
                if self.names is not None and name not in self.names:
                    self._state = _VERBATIM
                    return
                self.index += 1
                self.saw_tool_call = True
                self._name, self._id = name, self.new_id()
                self._raw += self._buf[: m.end()]
                self._buf = self._buf[m.end():]
                self._state = _ARGS
                return
            if end >= 0:
                self._whole_call(self._buf[:end], out)
                self._buf = self._buf[end + len(END):]
                self._state = _OUT
        elif st == _ARGS:
            self._scan_args(out)
        elif st in (_TAIL, _DROP):
            end = self._buf.find(END)
            if end >= 0:
                self._buf = self._buf[end + len(END):]
                self._state = _OUT
            else:
                keep = _partial(self._buf, END)
                self._buf = self._buf[len(self._buf) - keep:] if keep else ""
        elif st == _VERBATIM:
            end = self._buf.find(END)
            if end >= 0:
                out.append(ContentDelta(self._raw + self._buf[: end + len(END)]))
                self._buf = self._buf[end + len(END):]
                self._state = _OUT
            # else wait for the closing tag (or flush)

    def _scan_args(self, out: list[Any]) -> None:
        buf = self._buf
        i = 0
        n = len(buf)
        if not self._started:
            while i < n and buf[i].isspace():
                i += 1
            if i == n:
                self._buf = ""
                return
            self._started = True
            self._string_value = buf[i] == '"'
        start = i
        depth, in_str, esc = self._depth, self._in_str, self._esc
        done = -1
        while i < n:
            ch = buf[i]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
                    if depth == 0:
                        done = i + 1
                        break
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    done = i + 1
                    break
                if depth < 0:  # primitive value ended by the call's closing brace
                    done = i
                    break
            elif depth == 0 and ch in ",\n" and i > start:
                done = i
                break
            i += 1
        self._depth, self._in_str, self._esc = depth, in_str, esc
        piece = buf[start: done if done >= 0 else n]
        if self._string_value:
            self._pending = getattr(self, "_pending", "") + piece
            if done >= 0:
                try:
                    args = json.loads(self._pending)
                except ValueError:
                    args = self._pending
                self._emit(str(args), out)
                self._pending = ""
        elif piece or done >= 0:
            self._emit(piece.rstrip() if done >= 0 else piece, out)
        if done >= 0:
            self._buf = buf[done:]
            self._state = _TAIL
        else:
            self._buf = ""

    def _emit(self, piece: str, out: list[Any]) -> None:
        if self._id is not None:
            out.append(ToolCallDelta(self.index, piece, self._id, self._name))
            self._id = None
        elif piece:
            out.append(ToolCallDelta(self.index, piece))

    def _whole_call(self, body: str, out: list[Any]) -> None:
        """A call whose name did not come first: parse it whole at its end."""
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        name = obj.get("name") if isinstance(obj, dict) else None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not isinstance(name, str) or (self.names is not None and name not in self.names):
            out.append(ContentDelta(START + body + END))
            return
        self.index += 1
        self.saw_tool_call = True
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        out.append(ToolCallDelta(self.index, text, self.new_id(), name))

    def flush(self) -> list[Any]:
        out: list[Any] = []
        st, buf = self._state, self._buf
        self._buf = ""
        if st == _OUT and buf:
            out.append(ContentDelta(buf))
        elif st == _HEAD:
            self._whole_call(buf, out)
        elif st == _VERBATIM:
            out.append(ContentDelta(self._raw + buf))
        elif st == _ARGS and self._string_value and getattr(self, "_pending", ""):
            self._emit(self._pending, out)
        self._state = _OUT
        return out


def make_tool_parser(fmt: str, *, tools: Any, parallel_tool_calls: bool = True) -> HermesToolParser:
    """The parser for ``fmt``; only the Hermes/Qwen JSON format is built so far."""
    if fmt in ("hermes", "qwen", "qwen3"):
        return HermesToolParser(tools, parallel_tool_calls=parallel_tool_calls)
    raise ValueError(f"tool-call format {fmt!r} is not supported yet")
