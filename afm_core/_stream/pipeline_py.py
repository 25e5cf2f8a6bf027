"""One stream's token-to-event chain (sans-IO; pure twin of ``ext/stream/pipeline_c.pyx``).

    token id -> detokenizer -> stop strings -> reasoning splitter
             -> (content) tool-call tracker -> structured-output sanitizer -> events

Every stage is one of the stream-core components; this module only wires
them and keeps the order of events.  The engine's generation thread runs it
for every generated token, so it allocates little and branches early.
"""

from __future__ import annotations

from typing import Any, Protocol

from .events import ContentDelta, Event, ReasoningDelta
from .stops import StopMatcher

__all__ = ["StreamPipeline"]


class TextStage(Protocol):
    def feed(self, text: str) -> list[Any]: ...
    def flush(self) -> list[Any]: ...


class StreamPipeline:
    """Feed generated token ids; get events; ``finish()`` at the end."""

    def __init__(
        self,
        detokenizer: Any,
        *,
        stops: tuple[str, ...] = (),
        reasoning: TextStage | None = None,
        tools: TextStage | None = None,
        structured: TextStage | None = None,
    ):
        self._detok = detokenizer
        self._stops = StopMatcher(stops) if stops else None
        self._reasoning = reasoning
        self._tools = tools
        self._structured = structured
        self.text_chars = 0

    @property
    def saw_tool_call(self) -> bool:
        return bool(self._tools is not None and getattr(self._tools, "saw_tool_call", False))

    def feed_token(self, token_id: int, out: list[Event]) -> bool:
        """Append the events ``token_id`` completes to ``out``; True when a stop string hit."""
        text = self._detok.feed(token_id)
        if not text:
            return False
        stopped = False
        if self._stops is not None:
            text, stopped = self._stops.feed(text)
        if text:
            self._route(text, out)
        return stopped

    def finish(self, out: list[Event]) -> None:
        """Flush every stage (end of stream)."""
        text = self._detok.flush()
        if self._stops is not None:
            if text:
                text, _ = self._stops.feed(text)
            text += self._stops.flush()
        if text:
            self._route(text, out)
        if self._reasoning is not None:
            self._content(self._reasoning.flush(), out)
        if self._tools is not None:
            self._structure(self._tools.flush(), out)
        if self._structured is not None:
            out.extend(self._structured.flush())

    def _route(self, text: str, out: list[Event]) -> None:
        self.text_chars += len(text)
        if self._reasoning is None:
            self._content([ContentDelta(text)], out)
        else:
            self._content(self._reasoning.feed(text), out)

    def _content(self, events: list[Any], out: list[Event]) -> None:
        tools = self._tools
        for ev in events:
            if type(ev) is ReasoningDelta:
                out.append(ev)
            elif tools is not None:
                self._structure(tools.feed(ev.text), out)
            else:
                self._structure([ev], out)

    def _structure(self, events: list[Any], out: list[Event]) -> None:
        st = self._structured
        if st is None:
            out.extend(events)
            return
        for ev in events:
            if type(ev) is ContentDelta:
                out.extend(st.feed(ev.text))
            else:
                out.append(ev)
