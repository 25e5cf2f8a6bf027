"""Prefixes held in a prompt cache against eviction for a while (prompt
caching's breakpoints), shared by the memory and the disk tier (sans-IO: the
caller gives the time).

A pin is ``(space, prefix)`` (``space``: the memory tier's model key, or the
disk tier's adapter) with an expiry and its ttl; pinning again keeps the
later expiry and the longer ttl, and a read of the whole prefix holds it for
its ttl from then (Anthropic refreshes a cache each time it is used).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["Pins"]

Key = tuple[Hashable, tuple[int, ...]]


class Pins:
    """The live pins of one tier: ``(space, prefix) -> expiry``, each with its ttl."""

    def __init__(self) -> None:
        self._expiry: dict[Key, float] = {}
        self._ttl: dict[Key, float] = {}

    def pin(self, space: Hashable, tokens: Sequence[int], ttl: float, now: float) -> None:
        """Hold ``tokens`` for ``ttl`` seconds from ``now`` (a pin held longer keeps its expiry)."""
        if not tokens or ttl <= 0:
            return
        key = (space, tuple(tokens))
        self._expiry[key] = max(self._expiry.get(key, 0.0), now + ttl)
        self._ttl[key] = max(self._ttl.get(key, 0.0), ttl)

    def refresh(self, space: Hashable, tokens: Sequence[int], now: float) -> None:
        """A request read ``tokens``: every live pin on a prefix of them holds for its ttl from ``now``."""
        for key, expiry in self.live(now).items():
            prefix = key[1]
            if key[0] == space and len(prefix) <= len(tokens) and tuple(tokens[:len(prefix)]) == prefix:
                self._expiry[key] = max(expiry, now + self._ttl[key])

    def live(self, now: float) -> dict[Key, float]:
        """The live pins and their expiries (the expired ones are forgotten)."""
        for key in [k for k, expiry in self._expiry.items() if expiry <= now]:
            del self._expiry[key]
            del self._ttl[key]
        return dict(self._expiry)
