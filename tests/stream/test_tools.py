"""Tool-call tracker: Hermes unit tests, twin equivalence under random splits, fuzzing, factory."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afm_core._stream.events import ContentDelta, ToolCallDelta
from afm_core._stream.toolcalls.base import ToolCallFailure, new_call_id, partial
from afm_core._stream.toolcalls.registry import (
    FORMATS,
    guess_tool_format,
    make_tool_format,
    make_tool_tracker,
)
from tests.stream.helpers import PY, C, TwinSet, each_boundary, random_split
from tests.stream.tools_helpers import merged, run, tool, tracker

TOOLS = [tool("get_weather"), tool("read_file")]
HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris \\"FR\\"", "n": [1, {"a": "}"}], "u": "\\u00e9"}}\n</tool_call>\n'
    '<tool_call>\n{"name":"read_file","arguments":{"path":"README.md"}}\n</tool_call>tail'
)
HERMES_ARGS = ['{"city": "Paris \\"FR\\"", "n": [1, {"a": "}"}], "u": "\\u00e9"}', '{"path":"README.md"}']


def test_hermes_one_shot(twin: TwinSet) -> None:
    events, t = run(twin, "hermes", HERMES, tools=TOOLS)
    content, calls = merged(events)
    assert content == "Let me check.\ntail"  # the newline between the calls is layout
    assert [c["name"] for c in calls] == ["get_weather", "read_file"]
    assert [c["id"] for c in calls] == ["call_0", "call_1"]
    assert [c["arguments"] for c in calls] == HERMES_ARGS  # raw text, exactly as written
    assert t.saw_tool_call and t.calls == 2 and t.errors == []


def test_first_fragment_then_arguments_only(twin: TwinSet) -> None:
    events, _ = run(twin, "hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert events[0] == ToolCallDelta(0, "", "call_0", "f")
    assert all(e.id is None and e.name is None for e in events[1:])


def test_arguments_stream_before_the_call_ends(twin: TwinSet) -> None:
    t = tracker(twin, "hermes")
    events = t.feed('<tool_call>{"name": "f", "arguments": {"text": "hello wor')
    assert events[0] == ToolCallDelta(0, "", "call_0", "f")
    assert "".join(e.arguments for e in events) == '{"text": "hello wor'
    assert t.feed('ld"}') == [ToolCallDelta(0, 'ld"}')]
    assert t.feed("}\n</tool_call>") == []
    assert t.flush() == [] and t.errors == []


def test_default_ids_are_unique() -> None:
    a, b = new_call_id(), new_call_id()
    assert a.startswith("call_") and a != b and len(a) > 10


def test_name_after_arguments_is_buffered(twin: TwinSet) -> None:
    text = '<tool_call>{"arguments": {"x": [1, 2]}, "name": "f"}</tool_call>ok'
    content, calls = merged(run(twin, "hermes", text)[0])
    assert content == "ok"
    assert calls == [{"id": "call_0", "name": "f", "arguments": '{"x": [1, 2]}'}]


def test_arguments_as_json_string_are_unwrapped(twin: TwinSet) -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    _, calls = merged(run(twin, "hermes", text)[0])
    assert calls[0]["arguments"] == '{"a": 1}'


def test_unknown_tool_is_content(twin: TwinSet) -> None:
    text = 'a<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>b'
    events, t = run(twin, "hermes", text, tools=TOOLS)
    assert merged(events) == (text, [])
    assert not t.saw_tool_call


def test_not_a_call_object_is_content(twin: TwinSet) -> None:
    for text in ("<tool_call>hello</tool_call>", '<tool_call>{"x": 1}</tool_call>', "<tool_call>{"):
        events, t = run(twin, "hermes", text)
        assert merged(events) == (text, []), text
        assert not t.saw_tool_call


def test_parallel_false_keeps_only_the_first_call(twin: TwinSet) -> None:
    events, t = run(twin, "hermes", HERMES, tools=TOOLS, parallel_tool_calls=False)
    content, calls = merged(events)
    assert content == "Let me check.\ntail"  # the newline between the calls is layout
    assert [c["name"] for c in calls] == ["get_weather"] and t.dropped == 1


def test_layout_between_and_after_calls_is_not_content(twin: TwinSet) -> None:
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for pieces in (["a\n", call, "\n", call, "\n \n"], ["a\n", call, "\n", " ", call],
                   ["a\n" + call + "\n\n" + call + "\n"]):
        events, t = run(twin, "hermes", pieces)
        assert merged(events)[0] == "a\n" and t.calls == 2, pieces
    events, _ = run(twin, "hermes", call + "\n  then text \n" + call + " \n")
    assert merged(events)[0] == "\n  then text"  # whitespace before other text stays


def test_unclosed_call_at_flush(twin: TwinSet) -> None:
    events, t = run(twin, "hermes", 'x<tool_call>{"name": "f", "arguments": {"a": [1')
    content, calls = merged(events)
    assert content == "x" and calls[0]["arguments"] == '{"a": [1'
    assert t.errors == [ToolCallFailure(0, "tool call arguments not finished at end of stream")]
    assert t.saw_tool_call


def test_missing_end_tag_after_complete_arguments_is_fine(twin: TwinSet) -> None:
    events, t = run(twin, "hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert merged(events)[1][0]["arguments"] == '{"a": 1}' and t.errors == []


def test_malformed_streamed_arguments_close_with_an_error(twin: TwinSet) -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": <oops>}}</tool_call>after'
    events, t = run(twin, "hermes", text)
    content, calls = merged(events)
    assert content == "after" and calls[0]["arguments"] == '{"a": '
    assert t.errors == [ToolCallFailure(0, "malformed tool call arguments")]


def test_invalid_but_balanced_arguments_are_reported(twin: TwinSet) -> None:
    _, t = run(twin, "hermes", '<tool_call>{"name": "f", "arguments": [tru]}</tool_call>')
    assert len(t.errors) == 1 and t.errors[0].index == 0
    _, t = run(twin, "hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>')
    assert t.errors == [ToolCallFailure(0, "arguments are not a JSON object")]


def test_partial_start_tag_is_held_then_released(twin: TwinSet) -> None:
    t = tracker(twin, "hermes")
    assert t.feed("a <tool_") == [ContentDelta("a ")]
    assert t.feed("x") == [ContentDelta("<tool_x")]
    assert t.feed("<tool") == []
    assert t.flush() == [ContentDelta("<tool")]


# -- equivalence and oracles under random splits ---------------------------------

CASES = {
    "hermes": HERMES,
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "d": [1.5, -2e3, true, null]}}; '
    '{"name": "read_file", "parameters": {"path": "a\\\\b\\"c"}}',
    "mistral": 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
    '{"name": "read_file", "arguments": {"path": "x.md"}}] Done. [TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}',
    "qwen3_coder": 'Calling.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão "Paulo"\n</parameter>\n'
    '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\nand <tool_call>\n<function=read_file>\n'
    '<parameter=path>\n/tmp/a\n</parameter>\n</function>\n</tool_call>',
}
EXPECTED = {
    "hermes": ("Let me check.\ntail", [json.loads(a) for a in HERMES_ARGS]),
    "llama3_json": ("", [{"city": "Oslo", "d": [1.5, -2e3, True, None]}, {"path": 'a\\b"c'}]),
    "mistral": ("Sure. Done.", [{"city": "Rome"}, {"path": "x.md"}, {"city": "Nice"}]),
    "qwen3_coder": ("Calling.\n\nand", [{"city": 'São "Paulo"', "days": 3}, {"path": "/tmp/a"}]),
}
SCHEMA_TOOLS = [
    tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}),
    tool("read_file", {"path": {"type": "string"}}),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_shot_oracle(fmt: str, twin: TwinSet) -> None:
    events, t = run(twin, fmt, CASES[fmt], tools=SCHEMA_TOOLS)
    content, calls = merged(events)
    assert (content, [json.loads(c["arguments"]) for c in calls]) == EXPECTED[fmt]
    assert t.errors == [] and t.saw_tool_call


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_splits_match_one_shot_and_twins_agree(fmt: str, data: st.DataObject) -> None:
    text = CASES[fmt]
    pieces = random_split(data, text, 60)
    one_shot = merged(run(PY, fmt, text, tools=SCHEMA_TOOLS)[0])
    ev_c, t_c = run(C, fmt, pieces, tools=SCHEMA_TOOLS)
    ev_py, t_py = run(PY, fmt, pieces, tools=SCHEMA_TOOLS)
    assert ev_c == ev_py
    assert t_c.errors == t_py.errors == []
    assert merged(ev_c) == one_shot


@pytest.mark.parametrize("fmt", FORMATS)
def test_token_by_token(fmt: str, twin: TwinSet) -> None:
    text = CASES[fmt]
    events, _ = run(twin, fmt, each_boundary(text), tools=SCHEMA_TOOLS)
    assert merged(events) == merged(run(twin, fmt, text, tools=SCHEMA_TOOLS)[0])


FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", '{"name": "f", "arguments": ', '{"name": "g", ',
               '"arguments": ', '{"a": ', '"x\\"}', "[1, 2", "]", "}", "{", '"', "\\", ",", " ", "\n",
               "null", "<", "text", '"name"', ":", "é",
               '<tool_call>{"name": "f", "arguments": {"s": "x"}}</tool_call>', '<tool_call>\n{"name": "g"'],
    "llama3_json": ["<|python_tag|>", '{"name": "f", "parameters": ', '{"name": "g", ', '"parameters": ',
                    "{", "}", "[", "]", '"', "\\", ";", " ", "\n", "1", "tru", "e", "<|py", "hi", ":",
                    '{"name": "f", "parameters": {"n": 1}}', '{"parameters": {}, "name": "g"}'],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "f", "g", "x-1", "[", "]", "{", "}", '"', ",",
                '{"name": "f", "arguments": ', '"arguments": ', " ", "\n", "1", "hi", "\\", "[TOOL",
                '[TOOL_CALLS]f[ARGS]{"s": "x"}', '[TOOL_CALLS][{"name": "g", "arguments": {}}]'],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=f>", "<function=g>", "<function=",
                    "<parameter=s>", "<parameter=n>", "<parameter=o>", "</parameter>", "</function>",
                    "\n", "null", "1", "x", '"', "{", "}", "<", ">", "\\", "é", " ", "true", "</para",
                    "<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"],
}
FUZZ_TOOLS = [
    tool("f", {"s": {"type": "string"}, "n": {"type": "number"}, "o": {"type": "object"}}),
    tool("g", {"s": {"type": "string"}}),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parallel", [True, False])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fuzz_only_documented_outcomes(fmt: str, parallel: bool, data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[fmt]), max_size=30)))
    pieces = random_split(data, text, 20)
    ev_c, t_c = run(C, fmt, pieces, tools=FUZZ_TOOLS, parallel_tool_calls=parallel)
    ev_py, t_py = run(PY, fmt, pieces, tools=FUZZ_TOOLS, parallel_tool_calls=parallel)
    assert ev_c == ev_py
    assert t_c.errors == t_py.errors and t_c.dropped == t_py.dropped
    content, calls = merged(ev_c)  # checks fragment shape
    assert len(calls) == t_c.calls
    assert t_c.saw_tool_call == bool(calls)
    if not parallel:
        assert len(calls) <= 1
    assert all(c["name"] in ("f", "g") for c in calls)
    for err in t_c.errors:
        assert isinstance(err, ToolCallFailure) and err.index is not None and err.index < len(calls)
    failed = {e.index for e in t_c.errors}
    for i, c in enumerate(calls):
        if i not in failed:
            assert isinstance(json.loads(c["arguments"]), dict)
    if not calls:  # nothing became a call: the text is untouched unless something was dropped
        assert content == text or t_c.dropped
    ev_one, t_one = run(PY, fmt, text, tools=FUZZ_TOOLS, parallel_tool_calls=parallel)
    assert merged(ev_one) == (content, calls) and t_one.errors == t_c.errors  # split-independent


# -- factory and format guess -----------------------------------------------------


def test_factory_names_and_aliases() -> None:
    for name in (*FORMATS, "qwen", "llama3"):
        assert make_tool_format(name).name in FORMATS
    with pytest.raises(ValueError):
        make_tool_format("nope")
    assert type(make_tool_tracker("hermes")).__module__ in ("afm_core._stream.tools_c", "afm_core._stream.tools_py")


def test_guess_tool_format() -> None:
    assert guess_tool_format("{{ '<tool_call>\\n<function=' }} <parameter=") == "qwen3_coder"
    assert guess_tool_format("<tool_call>{{ tool | tojson }}</tool_call>") == "hermes"
    assert guess_tool_format("", ["[TOOL_CALLS]", "[ARGS]"]) == "mistral"
    assert guess_tool_format("{{- '<|python_tag|>' }} ipython") == "llama3_json"
    assert guess_tool_format("plain {{ messages }}", ["hello"]) is None
    assert guess_tool_format(None) is None


def test_partial_helper() -> None:
    assert partial("abc<tool", "<tool_call>") == 5
    assert partial("abc", "<tool_call>") == 0
    assert partial("<tool_call>", "<tool_call>") == 0


# -- a fenced JSON call at the start of the output (Qwen2.5-Coder's way) ----------------

FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'


def test_a_fenced_call_at_the_start_is_a_call(twin: TwinSet) -> None:
    for text in (FENCED, "\n " + FENCED + "\n", FENCED.replace("```json", "```")):
        events, t = run(twin, "hermes", text, tools=TOOLS)
        content, calls = merged(events)
        assert content == "" and [c["name"] for c in calls] == ["get_weather"], text
        assert json.loads(calls[0]["arguments"]) == {"city": "Paris"} and t.saw_tool_call


def test_a_fenced_call_split_anywhere(twin: TwinSet) -> None:
    text = FENCED + "\n"
    for pieces in [each_boundary(text)] + [[text[:k], text[k:]] for k in range(1, len(text))]:
        events, t = run(twin, "hermes", pieces, tools=TOOLS)
        content, calls = merged(events)
        assert content == "" and len(calls) == 1 and t.errors == [], pieces


def test_fences_that_are_not_calls_stay_content(twin: TwinSet) -> None:
    for text in ('```json\n{"a": 1}\n```', '```python\nprint(1)\n```', "``", "```",
                 'Here:\n```json\n{"name": "get_weather", "arguments": {}}\n```',
                 '```json\n{"name": "nope", "arguments": {}}\n```', "```jsx\n{}\n```"):
        events, t = run(twin, "hermes", text, tools=TOOLS)
        content, calls = merged(events)
        assert (content, calls, t.saw_tool_call) == (text, [], False), text


def test_text_after_a_fenced_call(twin: TwinSet) -> None:
    events, _ = run(twin, "hermes", FENCED + "\nDone.", tools=TOOLS)
    content, calls = merged(events)
    assert len(calls) == 1 and content == "\nDone."
