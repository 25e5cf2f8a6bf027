"""The prefix cache's index: mlx-lm's prompt trie, with a fast "longer" search.

The engine keeps finished requests' KV caches in mlx-lm's ``LRUPromptCache``,
which indexes them in a trie of token ids (``PromptTrie``).  A lookup walks
the new prompt down the trie and, when the walk leaves the stored paths
part-way, looks for the shortest stored sequence below that point: its
cache, trimmed to the common part, serves the prompt's prefix (this is how
a new chat reuses the cache of another that began the same way).  mlx-lm
finds it with a depth-first search of the whole subtree that copies the path
at every node; with a few hundred cached prompts that share a chat template's
start, that search visits every stored token after it and takes over a
millisecond per request, on the generation thread, between decode steps.

:class:`PrefixTrie` keeps, in every node, the length of the shortest stored
sequence at or below it (under the key ``"__min__"``), updated along the path
on every insert and removal.  The search then walks straight down to that
sequence: as many steps as it is long.  Every lookup returns what mlx-lm's
returns, except that among several shortest sequences it may pick another one
(any gives the same cached prefix).

:func:`served_prefix` says, without copying anything, which stored value
mlx-lm's ``fetch_nearest_cache`` would serve a prompt from and how many of
its tokens: the disk tier (:mod:`.disk_cache`) matches with the same rules,
and the engine compares the two tiers' answers with it.

**Pins** (Anthropic's ``cache_control`` breakpoints): :class:`PinningPromptCache`
is mlx-lm's cache with :meth:`~PinningPromptCache.pin`, which keeps a prefix
(a model key and its first tokens) held for ``ttl`` seconds of its ``clock``
(``time.monotonic``; tests inject theirs).  A pin is held by the entries
whose tokens begin with it (an entry serves every prefix of itself: the
trimmable caches of the engine's models; a request's entry holds its
prompt's breakpoints).  Eviction (the entry count, the byte budget) takes
the least recently inserted entry that is not the last holder of a live
pin (the most recently inserted holder of each pin is kept); only when
every entry left is one does it take the least recent of those.  An
expired pin protects nothing and is forgotten.  The disk tier
(:mod:`.disk_cache`) keeps pins of its own by the same rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, PromptTrie, PromptTrieResult, can_trim_prompt_cache

from .pins import Pins

__all__ = ["PinningPromptCache", "PrefixTrie", "make_prefix_cache", "memory_served", "served_prefix"]

_VALUE = "__value__"
_MIN = "__min__"
_NONE = 1 << 62


def _children(node: dict[Any, Any]) -> Any:
    return ((tok, child) for tok, child in node.items() if tok != _VALUE and tok != _MIN)


def _shortest(node: dict[Any, Any], depth: int) -> int:
    """The shortest stored length at or below ``node`` (at ``depth``), from its children's."""
    best = depth if _VALUE in node else _NONE
    for _, child in _children(node):
        best = min(best, child[_MIN])
    return best


class PrefixTrie(PromptTrie):
    """mlx-lm's ``PromptTrie`` with each node's shortest stored length below it."""

    def add(self, model: Any, tokens: list[int], value: Any) -> Any:
        root = self._trie.setdefault(model, {})
        n = len(tokens)
        node = root
        for tok in tokens:
            node[_MIN] = min(node.get(_MIN, _NONE), n)
            node = node.setdefault(tok, {})
        node[_MIN] = min(node.get(_MIN, _NONE), n)
        prev = node.get(_VALUE)
        node[_VALUE] = value
        return prev

    def _path(self, model: Any, tokens: list[int]) -> list[dict[Any, Any]]:
        path = [self._trie[model]]
        for tok in tokens:
            path.append(path[-1][tok])
        return path

    def _refresh(self, path: list[dict[Any, Any]]) -> None:
        for depth in range(len(path) - 1, -1, -1):
            path[depth][_MIN] = _shortest(path[depth], depth)

    def pop(self, model: Any, tokens: list[int]) -> Any:
        path = self._path(model, tokens)
        value = path[-1].pop(_VALUE)
        # drop the nodes left with nothing below them, then fix the lengths above
        for i in range(len(tokens), 0, -1):
            node = path[i]
            if _VALUE in node or any(True for _ in _children(node)):
                break
            del path[i - 1][tokens[i - 1]]
            path.pop()
        self._refresh(path)
        return value

    def pop_prefixes(self, model: Any, tokens: list[int]) -> list[tuple[int, Any]]:
        path = self._path(model, tokens)
        values = [(i, path[i].pop(_VALUE)) for i in range(len(tokens)) if _VALUE in path[i]]
        if values:
            self._refresh(path)
        return values

    def search(self, model: Any, tokens: list[int]) -> PromptTrieResult:
        if model not in self._trie:
            return PromptTrieResult(model, None, None, None, 0)
        node = self._trie[model]
        if not tokens and _VALUE in node:
            return PromptTrieResult(model, [], None, None, 0)
        last = -1
        index = 0
        while index < len(tokens) and tokens[index] in node:
            node = node[tokens[index]]
            if _VALUE in node:
                last = index
            index += 1
        if last == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last + 1] if last > 0 else None
        longer = None
        if index > 0:
            target = node[_MIN]
            path = tokens[:index]
            depth = index
            while not (depth == target and _VALUE in node):
                tok, node = next((t, c) for t, c in _children(node) if c[_MIN] == target)
                path.append(tok)
                depth += 1
            longer = path
        return PromptTrieResult(model, None, shorter, longer, index)


class PinningPromptCache(LRUPromptCache):
    """mlx-lm's ``LRUPromptCache`` whose eviction spares pinned prefixes (see the module docstring)."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self.clock = clock
        self._pins = Pins()  # keyed by (model, prefix)

    def pin(self, model: Any, tokens: list[int], ttl: float) -> None:
        """Hold ``tokens`` (a prefix of stored entries) for ``ttl`` seconds from now
        (a pin already held longer keeps its expiry)."""
        self._pins.pin(model, tokens, ttl, self.clock())

    def refresh(self, model: Any, tokens: list[int]) -> None:
        """A request read ``tokens`` from the cache: every live pin on a prefix of
        them holds for its ttl from now again (Anthropic's caches are refreshed each
        time they are used)."""
        self._pins.refresh(model, tokens, self.clock())

    def pins(self) -> dict[tuple[Any, tuple[int, ...]], float]:
        """The live pins, ``(model, prefix) -> expiry`` (the expired ones are forgotten)."""
        return self._pins.live(self.clock())

    def pinned(self, model: Any, tokens: list[int]) -> bool:
        """Whether the entry ``(model, tokens)`` is the one holding a live pin."""
        return (model, tuple(tokens)) in self._holders()

    def _order(self) -> list[tuple[Any, list[int]]]:
        """The entries, least recently inserted first."""
        return [entry for kind in self._lru._ordering for entry in self._lru._lrus[kind]]

    def _holders(self) -> set[tuple[Any, tuple[int, ...]]]:
        pins = self.pins()
        if not pins:
            return set()
        order = self._order()
        held: set[tuple[Any, tuple[int, ...]]] = set()
        for model, prefix in pins:
            n = len(prefix)
            first, last = prefix[0], prefix[-1]
            for m, toks in reversed(order):  # the most recent holder keeps the pin
                if m == model and len(toks) >= n and toks[n - 1] == last and toks[0] == first \
                        and tuple(toks[:n]) == prefix:
                    held.add((m, tuple(toks)))
                    break
        return held

    def _evict_one(self) -> None:
        order = self._order()
        held = self._holders()
        model, tokens = next(((m, t) for m, t in order if (m, tuple(t)) not in held), order[0])
        self._lru.remove(model, tokens)
        entry = self._trie.pop(model, tokens)
        self._n_bytes -= entry.nbytes
        self._n_bytes_by_type[entry.cache_type] -= entry.nbytes

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        bounds = self.max_size, self.max_bytes
        self.max_size, self.max_bytes = 1 << 62, 1 << 62  # mlx-lm's own eviction off: ours below
        try:
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        finally:
            self.max_size, self.max_bytes = bounds
        self.trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        most = max(0, n_sequences) if n_sequences is not None else 1 << 62
        budget = max(0, n_bytes) if n_bytes is not None else 1 << 62
        while len(self._lru) > most:
            self._evict_one()
        while self._n_bytes > budget and len(self._lru):
            self._evict_one()


def make_prefix_cache(max_size: int, max_bytes: int,
                      clock: Callable[[], float] = time.monotonic) -> PinningPromptCache:
    """A :class:`PinningPromptCache` indexed by a :class:`PrefixTrie`."""
    cache = PinningPromptCache(max_size=max_size, max_bytes=max_bytes, clock=clock)
    cache._trie = PrefixTrie()
    return cache


def served_prefix(trie: PromptTrie, model: Any, tokens: list[int],
                  trimmable: Callable[[Any], bool]) -> tuple[Any, int] | None:
    """The stored value ``LRUPromptCache.fetch_nearest_cache`` would serve
    ``tokens`` from, with the number of their tokens it serves (``len(tokens)``
    for an exact match; the engine then recomputes the last one), or None.
    Its rules: an exact match; else the shortest stored sequence that goes
    on past where ``tokens`` leave the stored paths, trimmed to the common
    part (if ``trimmable(value)``, and if that is longer than the longest
    stored prefix of ``tokens``); else that prefix."""
    result = trie.search(model, tokens)
    if result.exact is not None:
        return trie.get(model, result.exact), len(tokens)
    short = len(result.shorter) if result.shorter is not None else 0
    if result.longer is not None and result.common_prefix > short:
        value = trie.get(model, result.longer)
        if trimmable(value):
            return value, min(len(tokens) - 1, result.common_prefix)
    if result.shorter is not None and short > 0:
        return trie.get(model, result.shorter), short
    return None


def memory_served(cache: LRUPromptCache, model: Any, tokens: list[int]) -> int:
    """How many of ``tokens`` ``cache.fetch_nearest_cache`` would serve (0: none)."""
    found = served_prefix(cache._trie, model, tokens, lambda e: can_trim_prompt_cache(e.prompt_cache))
    return found[1] if found is not None else 0
