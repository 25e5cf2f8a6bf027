"""Stop strings over a text stream (sans-IO).

Generation must stop even when a stop string straddles token boundaries, and
clients must never see any part of it: text that could still begin a stop
string is held back until it is ruled out.
"""

from __future__ import annotations


class StopMatcher:
    """``feed(text) -> (text to release, stopped)``; ``flush()`` releases the held tail."""

    __slots__ = ("_held", "_keep", "_stops", "stopped")

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self._stops = tuple(s for s in stops if s)
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        cut = -1
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut], True
        # hold the longest suffix that is a prefix of some stop string
        hold = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if s.startswith(buf[-n:]):
                    hold = n
                    break
        if hold:
            self._held = buf[-hold:]
            return buf[:-hold], False
        self._held = ""
        return buf, False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.stopped else out
