"""Structured output for ``json_object`` / ``json_schema`` (sans-IO).

Content deltas in, content deltas out, so clients receive an unfenced JSON
payload: leading whitespace and a wrapping markdown code fence
(```` ```json ```` … ```` ``` ````, any info string, the newline after it
optional) are stripped, and so is trailing whitespace.  Only what is still
ambiguous is held back: the opening until it is clear whether a fence starts,
then a trailing whitespace run and a possible closing fence.  Text after the
closing fence (```` ``` ```` at the start of a line, which a raw newline
puts outside any JSON string) is dropped (``StructuredResult.trailing``
says so).

``flush()`` ends the stream and sets ``result``: the payload parses as JSON,
is an object for ``json_object``, and conforms to the schema for
``json_schema`` (``afm_core._stream.structured_schema``).  Validation is reported,
never raised.  No per-character Python loop runs here (``str.find`` and
slicing only), so this module has no Cython twin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .events import ContentDelta
from .structured_schema import validate
from .text import partial_tag as _partial

__all__ = ["StructuredOutput", "StructuredResult", "make_structured_output"]

FENCE = "```"
_INFO = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_+.-")
_WS = " \t\r\n"

_HEAD, _PLAIN, _FENCED, _DONE = range(4)


@dataclass(frozen=True, slots=True)
class StructuredResult:
    """What ``flush()`` found: ``valid`` and, if not, why (``errors``)."""

    valid: bool
    errors: tuple[str, ...] = ()
    fenced: bool = False
    trailing: bool = False  # non-whitespace text after the closing fence was dropped
    value: Any = None


def _trailing_ws(text: str) -> int:
    return len(text) - len(text.rstrip(_WS))


class StructuredOutput:
    """Sanitize one stream's content for a ``response_format``; ``flush()`` validates."""

    def __init__(self, response_format: dict[str, Any]) -> None:
        self.kind = str(response_format.get("type", "json_object"))
        spec = response_format.get("json_schema")
        self.schema: Any = spec.get("schema") if isinstance(spec, dict) else None
        self._state = _HEAD
        self._head = ""
        self._held: list[str] = []  # trailing whitespace / partial fence, not yet emitted
        self._parts: list[str] = []
        self._trailing = False
        self.result: StructuredResult | None = None

    @property
    def text(self) -> str:
        """The payload emitted so far."""
        return "".join(self._parts)

    def feed(self, text: str) -> list[ContentDelta]:
        """Content deltas for one delta of model content."""
        out: list[ContentDelta] = []
        st = self._state
        if st == _DONE:
            self._trailing = self._trailing or bool(text.strip())
            return out
        if st == _HEAD:
            self._head += text
            text = self._open()
            if self._state == _HEAD:
                return out
        if text:
            self._body(text, out)
        return out

    def _open(self) -> str:
        """Decide on the opening; the payload text that follows it."""
        head = self._head.lstrip(_WS)
        if not head:
            self._head = ""
            return ""
        if not head.startswith(FENCE):
            if FENCE.startswith(head):
                return ""  # "`" or "``": maybe a fence
            self._state = _PLAIN
            self._head = ""
            return head
        i, n = len(FENCE), len(head)
        while i < n and head[i] in _INFO:
            i += 1
        while i < n and head[i] in " \t":
            i += 1
        if i == n:
            self._head = head
            return ""
        if head[i] == "\n":
            i += 1
        elif head[i] == "\r" and head[i + 1 : i + 2] == "\n":
            i += 2
        elif head[i] == "\r" and i + 1 == n:
            self._head = head
            return ""
        self._state = _FENCED
        self._head = ""
        return head[i:].lstrip(_WS)

    def _body(self, text: str, out: list[ContentDelta]) -> None:
        if self._held:
            if text.strip(_WS) == "":  # still only whitespace: keep holding, no copying
                self._held.append(text)
                return
            text = "".join(self._held) + text
            self._held = []
        if self._state == _FENCED:
            i = text.find(FENCE)
            while i >= 0:
                before = text[:i].rstrip(" \t")
                if before.endswith("\n") or not (before or self._parts):  # at a line start
                    self._emit(before.rstrip(_WS), out)
                    self._state = _DONE
                    self._trailing = bool(text[i + len(FENCE) :].strip())
                    return
                i = text.find(FENCE, i + 1)
            keep = _partial(text, FENCE)
        else:
            keep = 0
        cut = len(text) - keep
        cut -= _trailing_ws(text[:cut])
        if cut < len(text):
            self._held.append(text[cut:])
        self._emit(text[:cut], out)

    def _emit(self, text: str, out: list[ContentDelta]) -> None:
        if text:
            self._parts.append(text)
            out.append(ContentDelta(text))

    def flush(self) -> list[ContentDelta]:
        """End of stream: release what was held (minus trailing whitespace); validate."""
        out: list[ContentDelta] = []
        if self._state == _HEAD:
            head = self._head.strip(_WS)
            if head:
                self._emit(head, out)  # "`" / "``" / an unterminated fence line
        elif self._held:
            held = "".join(self._held).rstrip(_WS)
            self._held = []
            self._emit(held, out)
        fenced = self._state in (_FENCED, _DONE)
        self._head = ""
        self.result = self._validate(fenced)
        return out

    def _validate(self, fenced: bool) -> StructuredResult:
        text = self.text
        try:
            value = json.loads(text)
        except ValueError as exc:
            return StructuredResult(False, (f"not valid JSON: {exc}",), fenced, self._trailing)
        errors: list[str] = []
        if self.kind == "json_object" and not isinstance(value, dict):
            errors.append("expected a JSON object")
        elif self.kind == "json_schema" and self.schema is not None:
            errors = validate(value, self.schema)
        return StructuredResult(not errors, tuple(errors), fenced, self._trailing, value)


def make_structured_output(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    """The sanitizer for a request's ``response_format`` (None for ``text`` / absent)."""
    if not response_format or response_format.get("type") not in ("json_object", "json_schema"):
        return None
    return StructuredOutput(response_format)
