"""The prefix cache's trie answers every lookup as mlx-lm's does."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import PromptTrie

from afm_core._mlx.prefix_cache import PrefixTrie, make_prefix_cache

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
