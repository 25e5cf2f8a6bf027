"""Structured output for ``json_object`` / ``json_schema`` (sans-IO).

Content deltas in, content deltas out: a wrapping markdown code fence
(```` ```json ```` … ```` ``` ````, with optional leading whitespace) is
stripped so clients receive an unfenced JSON payload.  Only what is still
ambiguous is held back: the opening until it is known whether a fence starts,
and a tail that could be the closing fence.  ``flush()`` ends the stream and
sets ``valid`` / ``error`` (JSON parses; an object for ``json_object``; the
schema's ``type``/``required`` at the top level for ``json_schema``).
"""

from __future__ import annotations

import json
from typing import Any

from ._events import ContentDelta

_OPEN = "```"


class JSONSanitizer:
    def __init__(self, response_format: dict[str, Any]):
        self.kind = response_format["type"]
        self.schema = (response_format.get("json_schema") or {}).get("schema")
        self._head = ""  # undecided opening
        self._decided = False
        self._fenced = False
        self._tail = ""  # held possible closing fence
        self._text: list[str] = []
        self.valid: bool | None = None
        self.error: str | None = None

    def feed(self, text: str) -> list[ContentDelta]:
        if not self._decided:
            self._head += text
            stripped = self._head.lstrip()
            if not stripped:
                return []
            if stripped.startswith(_OPEN):
                nl = stripped.find("\n")
                if nl < 0:
                    return []  # still reading the fence's info string
                self._fenced = True
                text = stripped[nl + 1:]
            elif _OPEN.startswith(stripped):
                return []
            else:
                text = stripped
            self._decided = True
            self._head = ""
        if not self._fenced:
            return self._out(text)
        buf = self._tail + text
        i = buf.find(_OPEN)
        if i >= 0:
            self._fenced = False
            self._closed = True
            self._tail = ""
            body = buf[:i].rstrip("\n")
            return self._out(body)
        keep = 0
        for n in range(min(len(buf), 4), 0, -1):
            if ("\n" + _OPEN).startswith(buf[-n:]) or _OPEN.startswith(buf[-n:]):
                keep = n
                break
        self._tail = buf[len(buf) - keep:]
        return self._out(buf[: len(buf) - keep])

    def _out(self, text: str) -> list[ContentDelta]:
        if getattr(self, "_closed", False) and not self._fenced and self._text and text == "":
            return []
        if not text:
            return []
        self._text.append(text)
        return [ContentDelta(text)]

    def flush(self) -> list[ContentDelta]:
        out: list[ContentDelta] = []
        if not self._decided and self._head.strip():
            out += self._out(self._head.strip())
        elif self._tail:
            out += self._out(self._tail)
        self._tail = self._head = ""
        self._validate("".join(self._text))
        return out

    def _validate(self, text: str) -> None:
        try:
            value = json.loads(text)
        except ValueError as exc:
            self.valid, self.error = False, f"not valid JSON: {exc}"
            return
        if self.kind == "json_object" and not isinstance(value, dict):
            self.valid, self.error = False, "not a JSON object"
            return
        schema = self.schema or {}
        if schema.get("type") == "object":
            if not isinstance(value, dict):
                self.valid, self.error = False, "not a JSON object"
                return
            missing = [k for k in schema.get("required", []) if k not in value]
            if missing:
                self.valid, self.error = False, f"missing required properties {missing}"
                return
        self.valid = True


def make_structured_sanitizer(response_format: dict[str, Any]) -> JSONSanitizer:
    return JSONSanitizer(response_format)
