"""Reasoning splitter: unit tests, a whole-text oracle, and twin equivalence."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afm_core._stream.events import ContentDelta, ReasoningDelta
from tests.stream.helpers import PY, C, TwinSet, cuts, feed_all, split_at


def run(twin: TwinSet, pieces: list[str], **kw: object) -> list[object]:
    return feed_all(twin.reasoning.ReasoningSplitter(**kw), pieces)


def channels(events: list[object]) -> tuple[str, str]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return reasoning, content


def reference(text: str, start: str, end: str, started: bool, enabled: bool) -> tuple[str, str]:
    """The non-streaming split the streaming splitter must agree with."""
    if not enabled:
        return "", text
    if started:
        if text.startswith(start):
            text = text[len(start) :]
        reasoning, _, content = text.partition(end)
        return reasoning, content
    before, sep, rest = text.partition(start)
    if not sep:
        return "", text
    reasoning, _, after = rest.partition(end)
    return reasoning, before + after


def test_basic_split(twin: TwinSet) -> None:
    events = run(twin, ["<think>", "let me", " think", "</think>", "\n\nAnswer."])
    assert events == [ReasoningDelta("let me"), ReasoningDelta(" think"), ContentDelta("\n\nAnswer.")]


def test_tags_split_across_deltas(twin: TwinSet) -> None:
    events = run(twin, ["Hi <", "th", "ink>r", "ea", "son</t", "hink", ">done"])
    assert channels(events) == ("reason", "Hi done")
    assert events[0] == ContentDelta("Hi ")


def test_started_in_prompt(twin: TwinSet) -> None:
    assert channels(run(twin, ["reasoning", "</think>", "answer"], started=True)) == (
        "reasoning",
        "answer",
    )
    # A repeated start tag at the very beginning is dropped.
    assert channels(run(twin, ["<thi", "nk>r</think>a"], started=True)) == ("r", "a")
    # Elsewhere it is reasoning text.
    assert channels(run(twin, ["x<think>r</think>a"], started=True)) == ("x<think>r", "a")


def test_disabled_passes_everything_through(twin: TwinSet) -> None:
    events = run(twin, ["<think>", "x", "</think>y"], enabled=False)
    assert events == [ContentDelta("<think>"), ContentDelta("x"), ContentDelta("</think>y")]


def test_only_first_block_and_stray_end(twin: TwinSet) -> None:
    assert channels(run(twin, ["<think>a</think>b<think>c</think>"])) == (
        "a",
        "b<think>c</think>",
    )
    assert channels(run(twin, ["a</think>b"])) == ("", "a</think>b")


def test_custom_tags(twin: TwinSet) -> None:
    kw = {"start": "◁think▷", "end": "◁/think▷"}
    assert channels(run(twin, ["◁thi", "nk▷deep◁/", "think▷ok"], **kw)) == ("deep", "ok")
    with pytest.raises(ValueError):
        twin.reasoning.ReasoningSplitter(start="", end="x")


def test_holds_back_only_a_possible_tag_prefix(twin: TwinSet) -> None:
    s = twin.reasoning.ReasoningSplitter(started=True)
    assert s.feed("abc</th") == [ReasoningDelta("abc")]
    assert s.feed("is") == [ReasoningDelta("</this")]
    assert s.feed("x<") == [ReasoningDelta("x")]
    assert s.feed("b") == [ReasoningDelta("<b")]
    assert s.feed("think>") == [ReasoningDelta("think>")]
    assert s.in_reasoning


def test_partial_held_then_flushed(twin: TwinSet) -> None:
    s = twin.reasoning.ReasoningSplitter(started=True)
    assert s.feed("abc</") == [ReasoningDelta("abc")]
    assert s.flush() == [ReasoningDelta("</")]
    s = twin.reasoning.ReasoningSplitter()
    assert s.feed("x <thi") == [ContentDelta("x ")]
    assert s.flush() == [ContentDelta("<thi")]
    s = twin.reasoning.ReasoningSplitter(started=True)
    assert s.feed("<th") == []
    assert s.flush() == [ReasoningDelta("<th")]


def test_empty_inputs(twin: TwinSet) -> None:
    s = twin.reasoning.ReasoningSplitter()
    assert s.feed("") == [] and s.flush() == []
    assert twin.reasoning.ReasoningSplitter(enabled=False).feed("") == []


# -- Hypothesis: random text, random boundaries ------------------------------

ALPHABET = st.sampled_from(["<", "/", ">", "t", "h", "i", "n", "k", "<think>", "</think>", "a", " ", "中", "😀"])


@st.composite
def split_text(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(ALPHABET, max_size=30)))
    return text, split_at(text, draw(cuts(text, 8)))


@settings(max_examples=300, deadline=None)
@given(data=split_text(), started=st.booleans(), enabled=st.booleans())
def test_twins_agree_and_match_reference(data: tuple[str, list[str]], started: bool, enabled: bool) -> None:
    text, pieces = data
    c = run(C, pieces, started=started, enabled=enabled)
    py = run(PY, pieces, started=started, enabled=enabled)
    assert c == py
    assert channels(c) == reference(text, "<think>", "</think>", started, enabled)
    assert all(e.text for e in c)  # never an empty delta


@settings(max_examples=200, deadline=None)
@given(data=split_text(), started=st.booleans())
def test_held_back_is_at_most_a_tag_prefix(data: tuple[str, list[str]], started: bool) -> None:
    _, pieces = data
    s = PY.reasoning.ReasoningSplitter(started=started)
    for piece in pieces:
        s.feed(piece)
        held = s._held
        assert not held or any(len(held) < len(t) and t.startswith(held) for t in (s.start, s.end))
