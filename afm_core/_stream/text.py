"""Small text helpers shared by the sans-IO stream stages (pure Python)."""

from __future__ import annotations

__all__ = ["partial_tag"]


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``.

    What a streaming parser must hold back because it may be the start of ``tag``.
    """
    if not tag:
        return 0
    n = len(text)
    lo = max(n - len(tag) + 1, 0)
    first = tag[0]
    i = text.find(first, lo)
    while i >= 0:
        if tag.startswith(text[i:]):
            return n - i
        i = text.find(first, i + 1)
    return 0
