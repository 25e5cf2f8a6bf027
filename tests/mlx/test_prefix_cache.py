"""The prefix cache's trie answers every lookup as mlx-lm's does."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import PromptTrie

from afm_core._mlx.prefix_cache import PrefixTrie, make_prefix_cache, memory_served, served_prefix

# short sequences over a small alphabet, so that they share prefixes often
seqs = st.lists(st.integers(0, 3), min_size=0, max_size=7)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), seqs),
        st.tuples(st.just("pop"), st.integers(0, 1000)),
        st.tuples(st.just("pop_prefixes"), st.integers(0, 1000)),
        st.tuples(st.just("search"), seqs),
    ),
    max_size=60,
)


def check_search(ours: PrefixTrie, theirs: PromptTrie, stored: set[tuple[int, ...]], tokens: list[int]) -> None:
    a, b = ours.search("m", tokens), theirs.search("m", tokens)
    assert (a.exact, a.shorter, a.common_prefix) == (b.exact, b.shorter, b.common_prefix)
    if b.longer is None:
        assert a.longer is None
    else:
        # the shortest stored sequence through the common prefix (which one of
        # several as short is not specified)
        assert a.longer is not None and len(a.longer) == len(b.longer)
        assert tuple(a.longer) in stored and a.longer[: a.common_prefix] == tokens[: a.common_prefix]


@settings(max_examples=400, deadline=None)
@given(ops)
def test_same_answers_as_mlx_lm(operations: list[tuple[str, Any]]) -> None:
    ours, theirs = PrefixTrie(), PromptTrie()
    stored: set[tuple[int, ...]] = set()
    for kind, arg in operations:
        if kind == "add":
            value = ("v", tuple(arg))
            assert ours.add("m", list(arg), value) == theirs.add("m", list(arg), value)
            stored.add(tuple(arg))
        elif kind in ("pop", "pop_prefixes") and stored:
            tokens = list(sorted(stored)[arg % len(stored)])
            if kind == "pop":
                assert ours.pop("m", tokens) == theirs.pop("m", tokens)
                stored.discard(tuple(tokens))
            else:
                popped = ours.pop_prefixes("m", tokens)
                assert popped == theirs.pop_prefixes("m", tokens)
                stored -= {tuple(tokens[:i]) for i, _ in popped}
        elif kind == "search":
            check_search(ours, theirs, stored, list(arg))
        for seq in stored:
            assert ours.get("m", list(seq)) == theirs.get("m", list(seq)) == ("v", seq)
            check_search(ours, theirs, stored, [*seq, 9])
            check_search(ours, theirs, stored, list(seq[:-1]))


def test_the_lru_cache_reuses_the_shortest_entry_through_a_shared_start() -> None:
    cache = make_prefix_cache(max_size=8, max_bytes=1 << 30)
    cache.insert_cache("m", [1, 2, 3, 4, 5, 6], [])
    cache.insert_cache("m", [1, 2, 3, 7, 8], [])
    cache.insert_cache("m", [1, 2, 9], [])
    result = cache._trie.search("m", [1, 2, 3, 5])
    assert result.longer == [1, 2, 3, 7, 8] and result.common_prefix == 3
    cache.trim_to(n_sequences=1)  # evicts the two oldest
    result = cache._trie.search("m", [1, 2, 3, 5])
    assert result.longer == [1, 2, 9] and result.common_prefix == 2


class _Fake:
    """A stand-in layer cache: its length, trimmable or not."""

    def __init__(self, n: int, trimmable: bool):
        self.offset, self.trimmable = n, trimmable

    nbytes = 1

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(seqs, st.booleans()), max_size=8), st.lists(seqs, min_size=1, max_size=8))
def test_served_prefix_says_what_fetch_nearest_cache_serves(stored: list[tuple[list[int], bool]],
                                                            prompts: list[list[int]]) -> None:
    """The disk tier's matching (and the tiers' comparison) follows mlx-lm's fetch."""
    cache = make_prefix_cache(max_size=64, max_bytes=1 << 30)
    for tokens, trimmable in stored:
        cache.insert_cache("m", list(tokens), [_Fake(len(tokens), trimmable)])
    for prompt in prompts:
        got, rest = cache.fetch_nearest_cache("m", list(prompt))
        served = len(prompt) - len(rest) if got is not None else 0
        assert memory_served(cache, "m", list(prompt)) == served
        if got is not None and served:
            # the value served_prefix names is the one fetched (its length, once trimmed)
            found = served_prefix(cache._trie, "m", list(prompt), lambda e: e.prompt_cache[0].is_trimmable())
            assert found is not None and found[1] == served
            assert got[0].offset == served


class _Layer:
    """A stand-in KV layer: a size and trimmable, as the engine's caches are."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def is_trimmable(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _stored(cache: Any) -> list[tuple[int, ...]]:
    return [tuple(t) for _, t in cache._order()]


def test_pinned_prefixes_survive_a_budget_squeeze_until_their_ttl() -> None:
    clock = _Clock()
    cache = make_prefix_cache(max_size=10, max_bytes=300, clock=clock)
    system = [1, 2, 3]
    cache.insert_cache("m", [*system, 10], [_Layer(100)])  # the session with a breakpoint
    cache.pin("m", system, 300.0)
    cache.insert_cache("m", [7, 7, 1], [_Layer(100)])
    cache.insert_cache("m", [8, 8, 1], [_Layer(100)])
    assert cache.nbytes == 300 and cache.pinned("m", [*system, 10])
    # a fourth entry: the least recent unpinned one goes, not the older pinned one
    cache.insert_cache("m", [9, 9, 1], [_Layer(100)])
    assert _stored(cache) == [(*system, 10), (8, 8, 1), (9, 9, 1)]
    cache.trim_to(n_bytes=100)  # the squeeze takes every unpinned entry first
    assert _stored(cache) == [(*system, 10)] and cache.nbytes == 100
    assert memory_served(cache, "m", [*system, 42, 43]) == 3
    # past its ttl the pin protects nothing: plain LRU again
    clock.now += 299.0
    assert cache.pins()
    clock.now += 2.0
    assert not cache.pins() and not cache.pinned("m", [*system, 10])
    cache.insert_cache("m", [5, 5], [_Layer(100)])
    cache.trim_to(n_bytes=100)
    assert _stored(cache) == [(5, 5)]


def test_a_pin_is_held_by_its_most_recent_entry_only() -> None:
    clock = _Clock()
    cache = make_prefix_cache(max_size=2, max_bytes=1 << 30, clock=clock)
    cache.pin("m", [1, 2], 3600.0)
    cache.insert_cache("m", [1, 2, 5], [_Layer(10)])
    cache.insert_cache("m", [1, 2, 6], [_Layer(10)])
    assert not cache.pinned("m", [1, 2, 5]) and cache.pinned("m", [1, 2, 6])
    cache.insert_cache("m", [4], [_Layer(10)])  # over max_size: the older holder goes
    assert _stored(cache) == [(1, 2, 6), (4,)]
    cache.insert_cache("m", [3], [_Layer(10)])
    assert _stored(cache) == [(1, 2, 6), (3,)]
    # another model's entries never hold it
    cache.insert_cache("other", [1, 2, 6], [_Layer(10)])
    assert [(m, tuple(t)) for m, t in cache._order()] == [("m", (1, 2, 6)), ("other", (1, 2, 6))]


def test_a_read_refreshes_the_pins_on_what_it_read() -> None:
    clock = _Clock()  # 100.0
    cache = make_prefix_cache(max_size=10, max_bytes=1000, clock=clock)
    cache.insert_cache("m", [1, 2, 3, 10], [_Layer(100)])
    cache.pin("m", [1, 2, 3], 300.0)
    cache.pin("m", [1, 2], 3600.0)
    clock.now = 350.0
    cache.refresh("m", [1, 2])  # covers the hour's pin only
    cache.refresh("x", [1, 2, 3, 10])  # another model (or adapter): nothing
    assert cache.pins() == {("m", (1, 2, 3)): 400.0, ("m", (1, 2)): 3950.0}
    cache.refresh("m", [1, 2, 3, 10, 11])
    assert cache.pins() == {("m", (1, 2, 3)): 650.0, ("m", (1, 2)): 3950.0}
    clock.now = 651.0
    cache.refresh("m", [1, 2, 3])
    assert cache.pins() == {("m", (1, 2)): 4251.0}  # the expired one stays expired; the hour's is read again
