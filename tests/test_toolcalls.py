"""Hermes tool-call fragments and the JSON sanitizer under arbitrary splits."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from afm_core._events import ContentDelta, ToolCallDelta
from afm_core._structured_output import JSONSanitizer
from afm_core._toolcalls import HermesToolParser

TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "read_file")]
TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris \\"FR\\"", "n": [1, {"a": "}"}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>tail'
)


def run(parser: HermesToolParser, text: str, cuts: list[int]) -> list:
    events, last = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[last:c])
        last = c
    return events + parser.flush()


def merged(events: list) -> tuple[str, dict[int, dict]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, dict] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            c = calls.setdefault(e.index, {"id": None, "name": None, "arguments": ""})
            if e.id is not None:
                assert c["id"] is None, "id only on the first fragment"
                c["id"], c["name"] = e.id, e.name
            c["arguments"] += e.arguments
    return content, calls


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, len(TEXT)), max_size=40))
def test_split_anywhere_gives_the_same_calls(cuts: list[int]) -> None:
    p = HermesToolParser(TOOLS, id_factory=lambda: "call_x")
    content, calls = merged(run(p, TEXT, cuts))
    assert content == "Let me check.\n\ntail"
    assert [json.loads(c["arguments"]) for c in calls.values()] == [
        {"city": 'Paris "FR"', "n": [1, {"a": "}"}]}, {"path": "README.md"}]
    assert [c["name"] for c in calls.values()] == ["get_weather", "read_file"]
    assert p.saw_tool_call


def test_arguments_stream_incrementally() -> None:
    p = HermesToolParser(TOOLS, id_factory=lambda: "call_1")
    events = []
    for ch in '<tool_call>{"name": "read_file", "arguments": {"path": "a very long path"}}</tool_call>':
        events += p.feed(ch)
    frags = [e for e in events if isinstance(e, ToolCallDelta)]
    assert len(frags) > 5  # not buffered until the end
    assert frags[0].id == "call_1" and frags[0].name == "read_file"
    assert all(f.id is None and f.name is None for f in frags[1:])


@given(st.text(alphabet="<>/{}\"tool_cal:namerguts ,", max_size=80), st.lists(st.integers(0, 80)))
def test_arbitrary_text_never_raises(text: str, cuts: list[int]) -> None:
    p = HermesToolParser(TOOLS)
    run(p, text, [c for c in cuts if c <= len(text)])


def test_unknown_tool_and_malformed_are_content() -> None:
    p = HermesToolParser(TOOLS)
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    content, calls = merged(run(p, text, [5, 17]))
    assert content == text and not calls
    p = HermesToolParser(TOOLS)
    content, calls = merged(run(p, "<tool_call>not json</tool_call>", []))
    assert content == "<tool_call>not json</tool_call>" and not calls
    p = HermesToolParser(TOOLS)
    content, calls = merged(run(p, "<tool_call>{\"arguments\": {}, \"name\": \"read_file\"}</tool_call>", []))
    assert calls[0]["name"] == "read_file" and json.loads(calls[0]["arguments"]) == {}


def test_parallel_false_keeps_one_call() -> None:
    p = HermesToolParser(TOOLS, parallel_tool_calls=False)
    _, calls = merged(run(p, TEXT, []))
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(['```json\n{"ok": true, "s": "a`b"}\n```', ' \n{"ok": true, "s": "a`b"}',
                        '```\n{"ok": true, "s": "a`b"}\n```\n']),
       st.lists(st.integers(0, 40)))
def test_fence_is_stripped_anywhere(text: str, cuts: list[int]) -> None:
    s = JSONSanitizer({"type": "json_object"})
    out, last = [], 0
    for c in sorted({c for c in cuts if c <= len(text)}) + [len(text)]:
        out += s.feed(text[last:c])
        last = c
    out += s.flush()
    assert json.loads("".join(e.text for e in out)) == {"ok": True, "s": "a`b"}
    assert s.valid


def test_schema_required_is_checked() -> None:
    s = JSONSanitizer({"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": ["a"]}}})
    s.feed('{"b": 1}')
    s.flush()
    assert s.valid is False and "a" in (s.error or "")
