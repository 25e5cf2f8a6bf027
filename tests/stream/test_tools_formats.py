"""Tool-call formats beyond Hermes: Qwen3-Coder XML, Llama-3 JSON, Mistral (both twins)."""

from __future__ import annotations

import json
from typing import Any

from afm_core._stream.events import ContentDelta, ToolCallDelta
from afm_core._stream.toolcalls.base import ToolCallFailure
from afm_core._stream.toolcalls.qwen3_coder import convert_value
from tests.stream.helpers import TwinSet, each_boundary, split_at
from tests.stream.tools_helpers import merged, run, tool, tracker


def args_of(events: list[Any]) -> list[Any]:
    return [json.loads(c["arguments"]) for c in merged(events)[1]]


# -- Qwen3-Coder ---------------------------------------------------------------------

QTOOLS = [tool("run", {
    "cmd": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"},
    "ok": {"type": "boolean"}, "opts": {"type": "object"}, "xs": {"type": "array"},
    "any": {}, "maybe": {"type": ["integer", "null"]},
})]


def qcall(params: str, name: str = "run") -> str:
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def p(name: str, value: str) -> str:
    return f"<parameter={name}>\n{value}\n</parameter>\n"


def test_qwen3_values_are_typed_from_the_schema(twin: TwinSet) -> None:
    text = qcall(p("cmd", "ls -la\n/tmp") + p("n", "5") + p("x", "2.5") + p("ok", "True")
                 + p("opts", '{"a": [1]}') + p("xs", "[1, 'b']") + p("any", '{"k": 1}')
                 + p("maybe", "null") + p("extra", "7"))
    events, t = run(twin, "qwen3_coder", text, tools=QTOOLS)
    expected = {"cmd": "ls -la\n/tmp", "n": 5, "x": 2.5, "ok": True, "opts": {"a": [1]},
                "xs": [1, "b"], "any": {"k": 1}, "maybe": None, "extra": "7"}
    calls = merged(events)[1]
    assert calls[0]["arguments"] == json.dumps(expected, ensure_ascii=False)
    assert t.errors == []


def test_qwen3_unconvertible_values_are_strings(twin: TwinSet) -> None:
    events, _ = run(twin, "qwen3_coder", qcall(p("n", "five") + p("x", "1e999") + p("ok", "yes")), tools=QTOOLS)
    assert args_of(events) == [{"n": "five", "x": "1e999", "ok": "yes"}]


def test_qwen3_string_values_stream_as_they_arrive(twin: TwinSet) -> None:
    t = tracker(twin, "qwen3_coder", QTOOLS)
    first = t.feed("<tool_call>\n<function=run>\n<parameter=cmd>\necho hel")
    assert first[0] == ToolCallDelta(0, "", "call_0", "run")
    assert "".join(e.arguments for e in first) == '{"cmd": "echo hel'
    assert t.feed('lo "x"\n') == [ToolCallDelta(0, 'lo \\"x\\"')]  # the newline is held
    assert t.feed("</parameter>\n</function>") == [ToolCallDelta(0, '"'), ToolCallDelta(0, "}")]
    assert t.flush() == [] and t.errors == []


def test_qwen3_null_string_is_null(twin: TwinSet) -> None:
    for value in ("null", "NULL"):
        events, _ = run(twin, "qwen3_coder", split_at(qcall(p("cmd", value)), range(40)), tools=QTOOLS)
        assert args_of(events) == [{"cmd": None}]
    events, _ = run(twin, "qwen3_coder", split_at(qcall(p("cmd", "nullify")), range(40)), tools=QTOOLS)
    assert args_of(events) == [{"cmd": "nullify"}]


def test_qwen3_no_parameters_and_several_functions(twin: TwinSet) -> None:
    text = "<tool_call>\n<function=run>\n</function>\n<function=run>\n" + p("n", "1") + "</function>\n</tool_call>"
    events, t = run(twin, "qwen3_coder", text, tools=QTOOLS)
    assert args_of(events) == [{}, {"n": 1}] and t.calls == 2


def test_qwen3_unknown_function_and_bad_block_are_content(twin: TwinSet) -> None:
    for text in (qcall(p("a", "1"), name="nope"), "<tool_call>\n{\"name\": \"run\"}\n</tool_call>"):
        events, t = run(twin, "qwen3_coder", text, tools=QTOOLS)
        assert merged(events) == (text, []) and not t.saw_tool_call


def test_qwen3_unclosed_function_gets_closed_json_and_an_error(twin: TwinSet) -> None:
    for tail in ("<parameter=cmd>\nabc", "<parameter=n>\n4", "<parameter=cmd>\nab\n</parameter>\n"):
        events, t = run(twin, "qwen3_coder", "<tool_call>\n<function=run>\n" + tail, tools=QTOOLS)
        assert isinstance(json.loads(merged(events)[1][0]["arguments"]), dict), tail
        assert t.errors == [ToolCallFailure(0, "tool call not closed before the end of the stream")]


def test_qwen3_parallel_false(twin: TwinSet) -> None:
    text = "a" + qcall(p("n", "1")) + "b" + qcall(p("n", "2")) + "c"
    events, t = run(twin, "qwen3_coder", text, tools=QTOOLS, parallel_tool_calls=False)
    content, calls = merged(events)
    assert content == "abc" and len(calls) == 1 and t.dropped == 1


def test_convert_value() -> None:
    assert convert_value("3.0", {"type": "integer"}, True) == 3
    assert convert_value("3.5", {"type": "integer"}, True) == "3.5"
    assert convert_value("{'a': (1, 2)}", {"type": "object"}, True) == {"a": (1, 2)}
    assert convert_value("{1, 2}", {"type": "array"}, True) == "{1, 2}"  # a set is not JSON
    assert convert_value("7", None, False) == "7"


# -- Llama-3 JSON ----------------------------------------------------------------------


def test_llama3_plain_output_is_content(twin: TwinSet) -> None:
    for text in ("Hello there", "  Hi {", "<|python", ' {"foo": 1}', "   "):
        events, t = run(twin, "llama3_json", each_boundary(text))
        assert merged(events) == (text, []) and not t.saw_tool_call, text


def test_llama3_calls_and_trailing_text(twin: TwinSet) -> None:
    text = ' {"name": "f", "parameters": {"a": 1}} ;\n{"type": "function", "name": "g", "parameters": {}} and more'
    events, _ = run(twin, "llama3_json", text)
    content, calls = merged(events)
    assert content == "and more" and [c["name"] for c in calls] == ["f", "g"]
    assert [c["arguments"] for c in calls] == ['{"a": 1}', "{}"]


def test_llama3_unknown_tool_is_content(twin: TwinSet) -> None:
    text = '{"name": "h", "parameters": {}}'
    events, _ = run(twin, "llama3_json", text, tools=[tool("f")])
    assert merged(events) == (text, [])


def test_llama3_arguments_stream(twin: TwinSet) -> None:
    t = tracker(twin, "llama3_json")
    events = t.feed('<|python_tag|>{"name": "f", "parameters": {"q": "abc')
    assert [e.arguments for e in events] == ["", '{"q": "abc']
    assert t.feed('"}}') == [ToolCallDelta(0, '"}')]


# -- Mistral ----------------------------------------------------------------------------


def test_mistral_header_form_with_call_id(twin: TwinSet) -> None:
    text = '[TOOL_CALLS]get-x[CALL_ID]a1B2c3D4e[ARGS]{"q": 1}[TOOL_CALLS]f[ARGS] "{\\"z\\": 2}"'
    events, _ = run(twin, "mistral", text)
    content, calls = merged(events)
    assert content == "" and [c["name"] for c in calls] == ["get-x", "f"]
    assert [c["arguments"] for c in calls] == ['{"q": 1}', '{"z": 2}']
    assert all(c["id"].startswith("call_") for c in calls)


def test_mistral_not_a_call_is_content(twin: TwinSet) -> None:
    for text in ("[TOOL_CALLS] hello", "[TOOL_CALLS][]", "[TOOL_CALLS]f(x)", "[TOOL_CALLS]", "[TOOL_CALLS][{"):
        events, t = run(twin, "mistral", text)
        assert merged(events) == (text, []) and not t.saw_tool_call, text


def test_mistral_list_form_parallel_false(twin: TwinSet) -> None:
    text = '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"a": [1]}}]ok'
    events, t = run(twin, "mistral", text, parallel_tool_calls=False)
    content, calls = merged(events)
    assert content == "ok" and [c["name"] for c in calls] == ["f"] and t.dropped == 1


def test_mistral_unterminated_arguments(twin: TwinSet) -> None:
    events, t = run(twin, "mistral", '[TOOL_CALLS]f[ARGS]{"a": "b')
    assert merged(events)[1][0]["arguments"] == '{"a": "b'
    assert t.errors == [ToolCallFailure(0, "tool call arguments not finished at end of stream")]


def test_partial_tag_is_released_at_flush(twin: TwinSet) -> None:
    events, _ = run(twin, "mistral", "x[TOOL")
    assert events == [ContentDelta("x"), ContentDelta("[TOOL")]
