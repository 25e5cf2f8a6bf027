"""Reasoning splitter: text deltas in, ReasoningDelta / ContentDelta out (pure twin).

Follows vLLM's ``qwen3`` reasoning parser, with the engine telling us what
the prompt did instead of guessing:

* ``enabled=False`` (thinking turned off; the template already closed the
  block): everything is content and tags pass through verbatim, as vLLM
  does once the prompt holds the end tag.
* ``started=True`` (the prompt opened the block, e.g. Qwen3-Thinking-2507):
  text is reasoning until the end tag; a start tag at the very beginning of
  the output is dropped (vLLM strips a repeated start tag).
* otherwise text is content until the first start tag, reasoning until the
  end tag, and content after it.  Only the first block is extracted; later
  tags are content.  An end tag before any start tag is content.

Text is kept verbatim (no whitespace trimming around tags).  Only a suffix
that could be the beginning of the awaited tag is held back; ``flush()``
releases it in the current channel.
"""

from __future__ import annotations

from .events import ContentDelta, ReasoningDelta
from .text import partial_tag as _partial

__all__ = ["ReasoningSplitter"]

# States.
_PASS = 0  # everything is content
_BEFORE = 1  # content, waiting for the start tag
_FRESH = 2  # reasoning, nothing emitted yet: a leading start tag is dropped
_INSIDE = 3  # reasoning, waiting for the end tag

Event = ContentDelta | ReasoningDelta


class ReasoningSplitter:
    """Split one stream's text into reasoning and content."""

    def __init__(
        self,
        start: str = "<think>",
        end: str = "</think>",
        *,
        started: bool = False,
        enabled: bool = True,
    ) -> None:
        if not start or not end:
            raise ValueError("reasoning tags must be non-empty")
        self.start = start
        self.end = end
        self._held = ""
        if not enabled:
            self._state = _PASS
        elif started:
            self._state = _FRESH
        else:
            self._state = _BEFORE

    @property
    def in_reasoning(self) -> bool:
        """Whether the next text would be reasoning."""
        return self._state in (_FRESH, _INSIDE)

    def feed(self, text: str) -> list[Event]:
        """Events for one text delta (possibly none while a tag prefix is held)."""
        state = self._state
        if state == _PASS:
            return [ContentDelta(text)] if text else []
        if self._held:
            text = self._held + text
            self._held = ""
        out: list[Event] = []
        while text:
            if state == _FRESH:
                if len(text) < len(self.start) and self.start.startswith(text):
                    self._held = text
                    break
                if text.startswith(self.start):
                    text = text[len(self.start) :]
                state = _INSIDE
                continue
            tag = self.end if state == _INSIDE else self.start
            i = text.find(tag)
            if i < 0:
                keep = _partial(text, tag)
                if keep:
                    self._held = text[len(text) - keep :]
                    text = text[: len(text) - keep]
                if text:
                    out.append(ReasoningDelta(text) if state == _INSIDE else ContentDelta(text))
                break
            if i:
                piece = text[:i]
                out.append(ReasoningDelta(piece) if state == _INSIDE else ContentDelta(piece))
            text = text[i + len(tag) :]
            if state == _INSIDE:
                state = _PASS
                if text:
                    out.append(ContentDelta(text))
                break
            state = _INSIDE
        self._state = state
        return out

    def flush(self) -> list[Event]:
        """End of stream: release a held tag prefix in the current channel."""
        held = self._held
        self._held = ""
        if not held:
            return []
        if self._state in (_FRESH, _INSIDE):
            return [ReasoningDelta(held)]
        return [ContentDelta(held)]
