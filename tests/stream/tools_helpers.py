"""Shared helpers for the tool-call tracker tests (either twin: a ``TwinSet``)."""

from __future__ import annotations

import itertools
from typing import Any

from afm_core._stream.events import ContentDelta, ToolCallDelta
from afm_core._stream.toolcalls.registry import make_tool_tracker
from tests.stream.helpers import TwinSet, feed_all


def tool(name: str, properties: dict[str, Any] | None = None) -> dict[str, Any]:
    params = {"type": "object", "properties": properties or {}}
    return {"type": "function", "function": {"name": name, "parameters": params}}


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def tracker(twin: TwinSet, fmt: str, tools: Any = None, **kw: Any) -> Any:
    return make_tool_tracker(fmt, tools=tools, impl=twin.tools, id_factory=ids(), **kw)


def run(twin: TwinSet, fmt: str, text: str | list[str], tools: Any = None,
        **kw: Any) -> tuple[list[Any], Any]:
    """Feed ``text`` (one piece, or a list of pieces) and flush; the events and the tracker."""
    t = tracker(twin, fmt, tools, **kw)
    return feed_all(t, [text] if isinstance(text, str) else text), t


def merged(events: list[Any]) -> tuple[str, list[dict[str, Any]]]:
    """Content and calls merged the way a correct client does (checking fragment shape)."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, dict[str, Any]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.index not in calls:
                assert e.id is not None and e.name is not None, "first fragment names the call"
                assert e.index == len(calls), "indices count up from 0"
                calls[e.index] = {"id": e.id, "name": e.name, "arguments": ""}
            else:
                assert e.id is None and e.name is None, "later fragments carry arguments only"
            calls[e.index]["arguments"] += e.arguments
    return content, [calls[i] for i in sorted(calls)]
