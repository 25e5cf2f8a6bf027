"""The OpenAI Responses translation (afm_core.api.responses and .responses_store),
without an engine: body validation into the engine's ChatRequest, engine events
into Responses events (checked against the openai SDK's own pydantic models) and
the Response object, SSE framing, and the bounded store with an injected clock."""

from __future__ import annotations

import copy
import json
import typing
from typing import Any

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from afm_core import (
    ContentDelta,
    Finish,
    LogprobsDelta,
    ReasoningDelta,
    RequestError,
    StreamFailure,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    UnsupportedError,
    Usage,
)
from afm_core.api import responses as api
from afm_core.api.responses_store import ResponseStore, StoredResponse

# the SDK's event classes by their "type"
_UNION = typing.get_args(ResponseStreamEvent)[0]
SDK_EVENTS = {typing.get_args(c.model_fields["type"].annotation)[0]: c for c in typing.get_args(_UNION)}

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": False}


def sdk_check(event: dict[str, Any]) -> None:
    """The event validates as the SDK's model for its type (the SDK's usage model
    also wants ``cache_write_tokens``, which afm does not know and leaves out)."""
    event = copy.deepcopy(event)
    response = event.get("response")
    if response is not None and response.get("usage"):
        response["usage"]["input_tokens_details"]["cache_write_tokens"] = 0
    SDK_EVENTS[event["type"]].model_validate(event)


def ids() -> Any:
    counters: dict[str, int] = {}

    def new(prefix: str) -> str:
        counters[prefix] = counters.get(prefix, 0) + 1
        return f"{prefix}_{counters[prefix]}"

    return new


def writer(body: dict[str, Any] | None = None) -> api.ResponseWriter:
    call = api.parse(body or {"input": "hi"})
    return api.ResponseWriter(call, id="resp_1", created_at=100, model="m", clock=lambda: 123.0,
                              ids=ids())


def run(w: api.ResponseWriter, *batches: list[Any]) -> list[dict[str, Any]]:
    out = w.start()
    for batch in batches:
        out += w.feed(batch)
    out += w.end()
    for e in out:
        sdk_check(e)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


# -- parse: input items -> chat messages --------------------------------------------------


def test_string_input_is_one_user_message_and_instructions_a_system_message() -> None:
    call = api.parse({"input": "hello", "instructions": "be brief", "model": "m"})
    assert call.chat.messages == ({"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "hello"})
    assert call.chat.model == "m" and call.store and not call.stream
    (item,) = call.input_items
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "hello"}]


def test_item_list_becomes_chat_turns() -> None:
    call = api.parse({"input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "what is "}, {"type": "input_text", "text": "the weather?"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "need a tool"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"c": 1}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "message", "role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "thanks"},
    ], "tools": [TOOL]})
    assert call.chat.messages == (
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "what is the weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "need a tool",
         "tool_calls": [
             {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"c": 1}'}},
             {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "thanks"},
    )


def test_assistant_turn_without_content_and_reasoning_rules() -> None:
    call = api.parse({"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "raw"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dropped"}]},
        {"role": "user", "content": "next"},
    ]})
    # reasoning_text content wins over the summary; a call-only turn has null content
    assert call.chat.messages[1] == {"role": "assistant", "content": None, "reasoning_content": "raw",
                                     "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": "{}"}}]}
    # reasoning that no assistant content or call follows is dropped
    assert call.chat.messages[3:] == ({"role": "user", "content": "next"},)


def test_function_call_output_must_answer_a_call() -> None:
    with pytest.raises(RequestError) as e:
        api.parse({"input": [{"role": "user", "content": "q"},
                             {"type": "function_call_output", "call_id": "nope", "output": "x"}]})
    assert e.value.param == "input[1].call_id" and "nope" in e.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [5]}, "input[0]"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [3]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 4}]}, "input[0].output"),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, "input[0].summary"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text"}]}]}, "input[0].summary[0]"),
    ({"input": [{"type": "mystery"}]}, "input[0].type"),
    ({"input": [{"type": ["unhashable"]}]}, "input[0].type"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": "x", "model": 3}, "model"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "store": 1}, "store"),
    ({"input": "x", "stream_options": []}, "stream_options"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"input": "x", "tools": {}}, "tools"),
    ({"input": "x", "tools": [3]}, "tools[0]"),
    ({"input": "x", "tools": [{"name": "f"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [TOOL, TOOL]}, "tools[1].name"),
    ({"input": "x", "tools": [{**TOOL, "parameters": 3}]}, "tools[0].parameters"),
    ({"input": "x", "tools": [{**TOOL, "strict": "yes"}]}, "tools[0].strict"),
    ({"input": "x", "tools": [{**TOOL, "description": 3}]}, "tools[0].description"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}},
     "tool_choice.name"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": {"x": 1}}},
     "tool_choice.name"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "x",
                                                     "tools": [{"type": "function", "name": "get_weather"}]}},
     "tool_choice.mode"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "tools": []}},
     "tool_choice.tools"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "allowed_tools",
                                                     "tools": [{"type": "function", "name": "zzz"}]}},
     "tool_choice.tools[0].name"),
    ({"input": "x", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"input": "x", "text": 3}, "text"),
    ({"input": "x", "text": {"format": 3}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}, "name": 3}}},
     "text.format.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}, "strict": "y"}}},
     "text.format.strict"),
    ({"input": "x", "text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"input": "x", "reasoning": "high"}, "reasoning"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "reasoning": {"summary": "long"}}, "reasoning.summary"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 1.5}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "include": "all"}, "include"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_p": "high"}, "top_p"),
    ({"input": "x", "user": 5}, "user"),
    ({"input": "x", "background": "no"}, "background"),
    ({"input": "x\ud800"}, "input"),
])
def test_invalid_bodies_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as e:
        api.parse(body)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    assert e.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "tools": [{"type": "sorcery"}]}, "tools[0].type"),
    ({"input": "x", "tools": [TOOL, {"type": "web_search_v9"}]}, "tools[1].type"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "sorcery"}}, "tool_choice.type"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "allowed_tools",
                                                     "tools": [{"type": "mcp", "server_label": "s"}]}},
     "tool_choice.tools[0]"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "context_management": [{"type": "compaction"}]}, "context_management"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
])
def test_unsupported_features_are_a_clear_400(body: dict[str, Any], param: str) -> None:
    with pytest.raises(UnsupportedError) as e:
        api.parse(body)
    assert e.value.status == 400 and e.value.param == param and e.value.code == "unsupported"


def test_not_an_object() -> None:
    for body in ([], "x", None, 3):
        with pytest.raises(RequestError) as e:
            api.parse(body)
        assert e.value.param == "body"


# -- parse: settings -------------------------------------------------------------------


def test_tools_are_flat_and_map_to_chat_tools() -> None:
    call = api.parse({"input": "x", "tools": [
        {"type": "function", "name": "a", "description": "A", "parameters": {"type": "object"},
         "strict": True},
        {"type": "function", "name": "b", "parameters": None, "strict": None},
    ], "parallel_tool_calls": False})
    assert call.chat.tools == (
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"},
                                          "description": "A", "strict": True}},
        {"type": "function", "function": {"name": "b", "parameters": {"type": "object", "properties": {}}}},
    )
    assert call.chat.tool_choice == "auto" and call.chat.parallel_tool_calls is False
    echo = dict(call.settings)
    assert echo["tools"][0] == {"type": "function", "name": "a", "description": "A",
                                "parameters": {"type": "object"}, "strict": True}
    assert echo["tools"][1]["strict"] is False and echo["tool_choice"] == "auto"
    assert echo["parallel_tool_calls"] is False


def test_tool_choice_forms() -> None:
    tools = [TOOL, {**TOOL, "name": "read_file"}]
    named = api.parse({"input": "x", "tools": tools,
                       "tool_choice": {"type": "function", "name": "read_file"}})
    assert named.chat.tool_choice == {"type": "function", "function": {"name": "read_file"}}
    assert dict(named.settings)["tool_choice"] == {"type": "function", "name": "read_file"}
    assert api.parse({"input": "x", "tools": tools, "tool_choice": "required"}).chat.tool_choice == "required"
    assert api.parse({"input": "x", "tools": tools, "tool_choice": "none"}).chat.tool_choice == "none"
    assert api.parse({"input": "x", "tool_choice": "none"}).chat.tool_choice == "none"
    allowed = api.parse({"input": "x", "tools": tools, "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "read_file"}]}})
    assert [t["function"]["name"] for t in allowed.chat.tools or ()] == ["read_file"]
    assert allowed.chat.tool_choice == "required"


def test_text_format_maps_to_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    call = api.parse({"input": "x", "text": {"format": {"type": "json_schema", "name": "r",
                                                        "schema": schema, "strict": True}}})
    assert call.chat.response_format == {"type": "json_schema",
                                         "json_schema": {"name": "r", "schema": schema, "strict": True}}
    assert call.chat.strict_schema == schema
    assert dict(call.settings)["text"]["format"]["strict"] is True
    loose = api.parse({"input": "x", "text": {"format": {"type": "json_schema", "schema": schema}}})
    assert loose.chat.strict_schema is None and loose.chat.response_format is not None
    assert api.parse({"input": "x", "text": {"format": {"type": "json_object"}}}).chat.response_format \
        == {"type": "json_object"}
    plain = api.parse({"input": "x", "text": {"format": {"type": "text"}, "verbosity": "low"}})
    assert plain.chat.response_format is None
    assert dict(plain.settings)["text"] == {"format": {"type": "text"}, "verbosity": "low"}


def test_reasoning_effort_and_sampling() -> None:
    assert api.parse({"input": "x", "reasoning": {"effort": "low"}}).chat.reasoning_effort == "low"
    assert api.parse({"input": "x", "reasoning": {"effort": "xhigh"}}).chat.reasoning_effort == "high"
    off = api.parse({"input": "x", "reasoning": {"effort": "none", "summary": "auto"}})
    assert off.chat.enable_thinking is False
    assert dict(off.settings)["reasoning"] == {"effort": "none", "summary": "auto"}
    call = api.parse({"input": "x", "max_output_tokens": 40, "temperature": 0.5, "top_p": 0.9,
                      "metadata": {"k": "v"}, "store": False, "stream": True})
    assert (call.chat.max_tokens, call.chat.temperature, call.chat.top_p) == (40, 0.5, 0.9)
    assert call.chat.stream and call.stream and not call.store
    echo = dict(call.settings)
    assert echo["metadata"] == {"k": "v"} and echo["max_output_tokens"] == 40 and echo["store"] is False
    logprobs = api.parse({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 2})
    assert logprobs.chat.logprobs and logprobs.chat.top_logprobs == 2 and logprobs.logprobs
    assert not api.parse({"input": "x", "include": ["reasoning.encrypted_content"]}).chat.logprobs


def test_previous_response_replays_its_items_without_its_instructions() -> None:
    first = api.parse({"input": "hello", "instructions": "old rules"})
    w = api.ResponseWriter(first, id="resp_prev", created_at=1, model="m", ids=ids())
    w.feed([ReasoningDelta("hm"), ContentDelta("hi there"), Finish("stop"), Usage(5, 3)])
    store = ResponseStore()
    store.put(w.stored())
    call = api.parse({"input": "and again", "previous_response_id": "resp_prev",
                      "instructions": "new rules"}, previous=store.get)
    assert call.chat.messages == (
        {"role": "system", "content": "new rules"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there", "reasoning_content": "hm"},
        {"role": "user", "content": "and again"},
    )
    assert [i["type"] for i in call.history] == ["message", "reasoning", "message"]
    assert call.conversation == call.history + call.input_items
    assert dict(call.settings)["previous_response_id"] == "resp_prev"
    # the next one chains on: its stored input is the whole conversation
    w2 = api.ResponseWriter(call, id="resp_next", created_at=2, model="m")
    w2.feed([ContentDelta("ok"), Finish("stop"), Usage(9, 1)])
    store.put(w2.stored())
    third = api.parse({"input": "3", "previous_response_id": "resp_next"}, previous=store.get)
    assert [m["content"] for m in third.chat.messages] == ["hello", "hi there", "and again", "ok", "3"]


def test_unknown_previous_response_is_404() -> None:
    for previous in (None, ResponseStore().get):
        with pytest.raises(RequestError) as e:
            api.parse({"input": "x", "previous_response_id": "resp_missing"}, previous=previous)
        assert e.value.status == 404 and e.value.param == "previous_response_id"
        assert e.value.code == "previous_response_not_found" and "resp_missing" in e.value.message


def test_function_call_output_may_answer_a_call_of_the_previous_response() -> None:
    first = api.parse({"input": "call it", "tools": [TOOL]})
    w = api.ResponseWriter(first, id="resp_p", created_at=1, model="m")
    w.feed([ToolCallDelta(0, '{"city": "Oslo"}', "call_9", "get_weather"), Finish("tool_calls"),
            Usage(5, 3)])
    store = ResponseStore()
    store.put(w.stored())
    call = api.parse({"previous_response_id": "resp_p", "tools": [TOOL], "input": [
        {"type": "function_call_output", "call_id": "call_9", "output": "cold"}]}, previous=store.get)
    assert call.chat.messages[-2:] == (
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "cold"},
    )


# -- events ------------------------------------------------------------------------


def test_text_event_sequence_and_final_response() -> None:
    w = writer({"input": "hi", "metadata": {"k": "v"}})
    out = run(w, [ContentDelta("Hel")], [ContentDelta("lo")], [Finish("stop"), Usage(7, 2, 3)])
    assert types(out) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert out[0]["response"]["status"] == "in_progress" and out[0]["response"]["output"] == []
    assert out[2]["item"] == {"id": "msg_1", "type": "message", "status": "in_progress",
                              "role": "assistant", "content": []}
    assert [e["delta"] for e in out if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    assert out[6]["text"] == "Hello" and out[7]["part"]["text"] == "Hello"
    final = out[-1]["response"]
    assert final == w.response and final["status"] == "completed" and final["completed_at"] == 123.0
    assert final["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 3},
                              "output_tokens": 2, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 9}
    assert final["metadata"] == {"k": "v"} and final["id"] == "resp_1" and final["object"] == "response"
    assert final["output"] == [{"id": "msg_1", "type": "message", "status": "completed",
                                "role": "assistant", "content": [
                                    {"type": "output_text", "text": "Hello", "annotations": [],
                                     "logprobs": []}]}]
    assert Response.model_validate(_with_cache_writes(final)).output_text == "Hello"
    assert w.done and w.feed([ContentDelta("late")]) == [] and w.end() == []


def _with_cache_writes(response: dict[str, Any]) -> dict[str, Any]:
    response = copy.deepcopy(response)
    response["usage"]["input_tokens_details"]["cache_write_tokens"] = 0
    return response


def test_reasoning_then_text() -> None:
    w = writer()
    w.set_reasoning_tokens(2)
    out = run(w, [ReasoningDelta("let me "), ReasoningDelta("think")], [ContentDelta("Answer")],
              [Finish("stop"), Usage(4, 5)])
    assert types(out)[2:] == [
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert out[6]["text"] == "let me think" and out[6]["summary_index"] == 0
    reasoning, message = w.response["output"]
    assert reasoning == {"id": "rs_1", "type": "reasoning", "status": "completed",
                         "summary": [{"type": "summary_text", "text": "let me think"}]}
    assert message["content"][0]["text"] == "Answer" and message["id"] == "msg_1"
    assert [e["output_index"] for e in out if e["type"] == "response.output_item.added"] == [0, 1]
    assert w.response["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    assert w.reasoning_text() == "let me think" and w.reasoning_text(0) == "let me think"


def test_function_call_arguments_stream_fragment_by_fragment() -> None:
    w = writer({"input": "x", "tools": [TOOL, {**TOOL, "name": "read_file"}]})
    out = run(w,
              [ContentDelta("Checking.")],
              [ToolCallDelta(0, "", "call_a", "get_weather")],
              [ToolCallDelta(0, '{"ci')], [ToolCallDelta(0, 'ty": "Paris"}')],
              [ToolCallDelta(1, '{"path"', "call_b", "read_file"), ToolCallDelta(0, "")],
              [ToolCallDelta(1, ': "README.md"}')],
              [Finish("tool_calls"), Usage(9, 8)])
    deltas = [(e["output_index"], e["delta"]) for e in out if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == [(1, '{"ci'), (1, 'ty": "Paris"}'), (2, '{"path"'), (2, ': "README.md"}')]
    # the message closes when the first call starts; the calls close at the end, in order
    done = [(e["type"], e.get("output_index")) for e in out if e["type"].endswith(".done")]
    assert done == [("response.output_text.done", 0), ("response.content_part.done", 0),
                    ("response.output_item.done", 0),
                    ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
                    ("response.function_call_arguments.done", 2), ("response.output_item.done", 2)]
    added = [e["item"] for e in out if e["type"] == "response.output_item.added"][1:]
    assert added[0] == {"id": "fc_1", "type": "function_call", "status": "in_progress", "arguments": "",
                        "call_id": "call_a", "name": "get_weather"}
    args_done = [e["arguments"] for e in out if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args_done] == [{"city": "Paris"}, {"path": "README.md"}]
    assert out[-1]["type"] == "response.completed"
    calls = w.response["output"][1:]
    assert [(c["call_id"], c["name"], c["status"]) for c in calls] == [
        ("call_a", "get_weather", "completed"), ("call_b", "read_file", "completed")]


def test_text_after_a_call_is_a_new_message() -> None:
    w = writer({"input": "x", "tools": [TOOL]})
    run(w, [ContentDelta("a"), ToolCallDelta(0, "{}", "call_a", "get_weather"), ContentDelta("b"),
            Finish("tool_calls"), Usage(1, 1)])
    assert [(i["type"], i["status"]) for i in w.response["output"]] == [
        ("message", "completed"), ("function_call", "completed"), ("message", "completed")]


def test_max_output_tokens_is_incomplete() -> None:
    w = writer({"input": "x", "max_output_tokens": 2})
    out = run(w, [ContentDelta("ab")], [Finish("length"), Usage(3, 2)])
    assert out[-1]["type"] == "response.incomplete"
    final = out[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and final["completed_at"] is None
    assert [e["item"]["status"] for e in out if e["type"] == "response.output_item.done"] == ["incomplete"]
    assert final["usage"]["output_tokens"] == 2


def test_cancelled_ends_with_status_cancelled() -> None:
    w = writer()
    out = run(w, [ReasoningDelta("r")], [Finish("cancelled"), Usage(3, 1)])
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["status"] == "cancelled"
    assert out[-1]["response"]["incomplete_details"] is None
    assert w.response["output"][0]["status"] == "incomplete"


def test_failure_mid_stream() -> None:
    w = writer({"input": "x", "tools": [TOOL]})
    out = run(w, [ContentDelta("a"), ToolCallDelta(0, '{"x', "call_a", "get_weather")],
              [StreamFailure("generation failed: boom", code="generation_failed")])
    assert types(out)[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                               "response.failed"]
    final = out[-1]["response"]
    assert final["status"] == "failed" and final["usage"] is None
    assert final["error"] == {"code": "server_error", "message": "generation failed: boom",
                              "type": "server_error"}
    assert [i["status"] for i in final["output"]] == ["completed", "incomplete"]


def test_end_without_finish_fails_and_finish_without_usage_completes() -> None:
    w = writer()
    out = run(w, [ContentDelta("a")])
    assert out[-1]["type"] == "response.failed"
    assert "ended before it finished" in out[-1]["response"]["error"]["message"]
    w = writer()
    out = run(w, [ContentDelta("a"), Finish("stop")])
    assert out[-1]["type"] == "response.completed" and out[-1]["response"]["usage"] is None


def test_empty_answer_is_an_empty_message() -> None:
    w = writer()
    out = run(w, [Finish("stop"), Usage(3, 1)])
    assert types(out) == ["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added", "response.output_text.done",
                          "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert w.response["output"][0]["content"][0]["text"] == ""


def test_abort_marks_cancelled_without_events() -> None:
    w = writer()
    w.start()
    w.feed([ContentDelta("par")])
    w.abort()
    assert w.done and w.status == "cancelled" and w.response["usage"] is None
    assert w.response["output"][0]["status"] == "incomplete"
    assert w.feed([ContentDelta("x")]) == [] and w.fail("x") == []


def test_feed_starts_the_response_itself() -> None:
    w = writer()
    out = w.feed([ContentDelta("a")])
    assert types(out)[:2] == ["response.created", "response.in_progress"]
    assert w.start() == []


def _lp(token: str, value: float) -> LogprobsDelta:
    return LogprobsDelta((TokenLogprob(token, value, tuple(token.encode()), (TopLogprob("z", -9.0, (122,)),)),))


def test_logprobs_ride_with_their_text_and_skip_reasoning_and_calls() -> None:
    w = writer({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 1,
                "tools": [TOOL]})
    out = run(w,
              [ReasoningDelta("r"), _lp("r", -0.1)],          # a reasoning token: dropped
              [ContentDelta("a"), _lp("a", -0.5)],            # joins its delta
              [_lp("<", -0.2)],                               # held back ...
              [ContentDelta("<b"), _lp("b", float("-inf"))],  # ... joins the next delta, with b's
              [ToolCallDelta(0, "{}", "call_a", "get_weather"), _lp("}", -0.3)],  # call markup: dropped
              [Finish("tool_calls"), Usage(1, 5)])
    deltas = [e for e in out if e["type"] == "response.output_text.delta"]
    assert [[lp["token"] for lp in d["logprobs"]] for d in deltas] == [["a"], ["<", "b"]]
    assert deltas[1]["logprobs"][1]["logprob"] == -9999.0
    assert deltas[0]["logprobs"][0]["top_logprobs"] == [{"token": "z", "bytes": [122], "logprob": -9.0}]
    message = w.response["output"][1]
    assert [lp["token"] for lp in message["content"][0]["logprobs"]] == ["a", "<", "b"]
    # without asking, no logprobs at all
    w = writer()
    out = run(w, [ContentDelta("a"), _lp("a", -0.5)], [Finish("stop"), Usage(1, 1)])
    assert all(e.get("logprobs", []) == [] for e in out)


def test_encode_frames_parse_back_to_the_events() -> None:
    w = writer()
    events = w.start() + w.feed([ContentDelta('quote " and \n newline and ünïcode'), Finish("stop"),
                                 Usage(1, 1)])
    raw = api.encode(events)
    frames = raw.decode().split("\n\n")
    assert frames[-1] == ""
    parsed = []
    for f in frames[:-1]:
        name, data = f.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[6:])
        assert obj["type"] == name[7:]
        parsed.append(obj)
    assert parsed == events


def test_new_ids() -> None:
    a, b = api.new_id("resp"), api.new_id("resp")
    assert a != b and a.startswith("resp_") and len(a) == 5 + 48


# -- n choices (afm's extension) -------------------------------------------------------


def sdk_accumulate(events: list[dict[str, Any]]) -> Any:
    """The SDK's own stream accumulator (what ``client.responses.stream`` runs) over
    the events, each parsed as the SDK parses a stream's; the final Response."""
    state: Any = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=copy.deepcopy(event)))
    assert state._completed_response is not None
    return state._completed_response


def multi(body: dict[str, Any]) -> api.ResponseWriter:
    return api.ResponseWriter(api.parse(body), id="resp_n", created_at=100, model="m",
                              clock=lambda: 123.0, ids=ids())


def run_choices(w: api.ResponseWriter, *steps: list[tuple[int, list[Any]]]) -> list[dict[str, Any]]:
    """Feed each step's (choice, batch) pairs; check the events as :func:`run` does."""
    out = w.start()
    for step in steps:
        for choice, batch in step:
            out += w.feed(batch, choice)
    out += w.end()
    for e in out:
        sdk_check(e)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


@pytest.mark.parametrize("n", [0, 17, -1, "x", 1.5, True, [2], {"n": 2}])
def test_bad_n_names_n(n: Any) -> None:
    with pytest.raises(RequestError) as e:
        api.parse({"input": "x", "n": n})
    assert e.value.status == 400 and e.value.param == "n" and "'n'" in e.value.message


def test_n_runs_one_request_per_choice_and_is_echoed_above_1() -> None:
    call = api.parse({"input": "x", "n": 3})
    assert call.n == 3 and len(call.chat.per_choice()) == 3
    assert all(r.n == 1 and r.messages == call.chat.messages for r in call.chat.per_choice())
    assert dict(call.settings)["n"] == 3
    assert api.parse({"input": "x", "n": 2.0}).n == 2
    for one in (api.parse({"input": "x"}), api.parse({"input": "x", "n": 1})):
        assert one.n == 1 and "n" not in dict(one.settings)


def test_choices_interleave_by_output_index_and_sum_usage() -> None:
    w = multi({"input": "x", "n": 2, "stream": True})
    w.set_reasoning_tokens(1, 0)
    w.set_reasoning_tokens(3, 1)
    out = run_choices(
        w,
        [(0, [ReasoningDelta("r0")]), (1, [ContentDelta("B")])],
        [(1, [ContentDelta("b")]), (0, [ContentDelta("A")])],
        [(0, [Finish("stop"), Usage(7, 4, 2)])],
        [(1, [ReasoningDelta("r1"), Finish("stop"), Usage(7, 5, 0)])],
    )
    added = [e for e in out if e["type"] == "response.output_item.added"]
    # dense, in the order the items were added, whichever choice they belong to
    assert [(e["output_index"], e["item"]["type"], e["item"]["choice_index"]) for e in added] == [
        (0, "reasoning", 0), (1, "message", 1), (2, "message", 0), (3, "reasoning", 1)]
    deltas = [(e["output_index"], e["delta"]) for e in out if e["type"] == "response.output_text.delta"]
    assert deltas == [(1, "B"), (1, "b"), (2, "A")]
    # choice 0's items close at its finish, before choice 1's end; one terminal event at the end
    kinds = types(out)
    assert kinds.count("response.completed") == 1 and kinds[-1] == "response.completed"
    done = [(e["output_index"], e["item"]["status"]) for e in out if e["type"] == "response.output_item.done"]
    assert done == [(0, "completed"), (2, "completed"), (1, "completed"), (3, "completed")]
    final = out[-1]["response"]
    assert final == w.response and final["status"] == "completed" and final["n"] == 2
    assert [(i["id"], i["choice_index"]) for i in final["output"]] == [  # streamed: output_index order
        ("rs_1", 0), ("msg_1", 1), ("msg_2", 0), ("rs_2", 1)]
    assert final["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 2},
                              "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 4},
                              "total_tokens": 16}
    assert w.reasoning_text(0) == "r0" and w.reasoning_text(1) == "r1"
    got = sdk_accumulate(out)
    assert [(o.id, o.model_extra["choice_index"]) for o in got.output] == [
        ("rs_1", 0), ("msg_1", 1), ("msg_2", 0), ("rs_2", 1)]
    assert Response.model_validate(_with_cache_writes(final)).output[1].model_extra == {"choice_index": 1}


def test_not_streamed_output_is_grouped_by_choice() -> None:
    w = multi({"input": "x", "n": 3})
    run_choices(w, [(2, [ContentDelta("c")]), (0, [ContentDelta("a")]), (1, [ContentDelta("b")])],
                [(i, [Finish("stop"), Usage(3, 1)]) for i in (1, 0, 2)])
    output = w.response["output"]
    assert [(i["choice_index"], i["content"][0]["text"]) for i in output] == [(0, "a"), (1, "b"), (2, "c")]
    assert w.response["usage"]["output_tokens"] == 3 and w.response["usage"]["input_tokens"] == 3


def test_one_choice_at_max_output_tokens_makes_it_incomplete() -> None:
    w = multi({"input": "x", "n": 2, "max_output_tokens": 2, "stream": True})
    out = run_choices(w, [(0, [ContentDelta("ab"), Finish("length"), Usage(3, 2)])],
                      [(1, [ContentDelta("c"), Finish("stop"), Usage(3, 1)])])
    assert types(out).count("response.incomplete") == 1 and out[-1]["type"] == "response.incomplete"
    final = out[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(i["choice_index"], i["status"]) for i in final["output"]] == [(0, "incomplete"), (1, "completed")]
    assert final["usage"]["output_tokens"] == 3 and final["completed_at"] is None
    # while the other choice runs, the response is not done
    w = multi({"input": "x", "n": 2})
    w.feed([Finish("stop"), Usage(1, 1)], 0)
    assert w.ended(0) and not w.ended(1) and not w.done
    assert [i["status"] for i in w.response["output"]] == ["completed"]  # choice 0's empty message


def test_cancel_of_every_choice_and_a_failing_choice() -> None:
    w = multi({"input": "x", "n": 2, "stream": True, "tools": [TOOL]})
    out = run_choices(w, [(0, [ContentDelta("a")]), (1, [ToolCallDelta(0, '{"x', "call_b", "get_weather")])],
                      [(0, [Finish("cancelled"), Usage(2, 1)]), (1, [Finish("cancelled"), Usage(2, 1)])])
    final = out[-1]["response"]
    assert out[-1]["type"] == "response.incomplete" and final["status"] == "cancelled"
    assert final["incomplete_details"] is None
    assert [i["status"] for i in final["output"]] == ["incomplete", "incomplete"]
    # a failure in one choice fails the response; the other choice's open items close
    w = multi({"input": "x", "n": 2, "stream": True})
    out = run_choices(w, [(0, [ContentDelta("a")]), (1, [ContentDelta("b")])],
                      [(1, [StreamFailure("boom", code="generation_failed")])],
                      [(0, [ContentDelta("late")])])
    assert types(out)[-1] == "response.failed" and w.status == "failed"
    assert "late" not in json.dumps(out)
    assert [i["status"] for i in w.response["output"]] == ["incomplete", "incomplete"]


def test_a_choice_whose_stream_ends_early() -> None:
    w = multi({"input": "x", "n": 2})
    w.feed([ContentDelta("a"), Finish("stop")], 0)
    assert w.close(0)[-1]["type"] == "response.output_item.done" and w.ended(0) and not w.done
    out = w.close(1)  # no finish: the stream ended before it finished
    assert out[-1]["type"] == "response.failed" and "ended before" in w.response["error"]["message"]
    w = multi({"input": "x", "n": 2})
    w.feed([ContentDelta("a")], 0)
    w.abort()
    assert w.status == "cancelled" and w.response["usage"] is None


def test_a_stored_response_with_choices_is_not_continued() -> None:
    w = multi({"input": "x", "n": 2})
    run_choices(w, [(i, [ContentDelta("a"), Finish("stop"), Usage(3, 1)]) for i in (0, 1)])
    store = ResponseStore()
    store.put(w.stored())
    assert store.get("resp_n") is not None and store.get("resp_n").choices == 2  # type: ignore[union-attr]
    with pytest.raises(RequestError) as e:
        api.parse({"input": "y", "previous_response_id": "resp_n"}, previous=store.get)
    err = e.value
    assert err.status == 400 and err.param == "previous_response_id"
    assert err.code == "previous_response_has_choices" and "cannot be inferred" in err.message
    assert "choice_index" in err.message
    one = writer()
    run(one, [ContentDelta("a"), Finish("stop"), Usage(3, 1)])
    assert one.stored().choices == 1


# -- the store ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored(n: int) -> StoredResponse:
    return StoredResponse(response={"id": f"resp_{n}", "output": [{"id": f"msg_{n}"}]},
                          input_items=({"id": f"in_{n}"},))


def test_store_evicts_the_oldest_past_its_size() -> None:
    clock = Clock()
    store = ResponseStore(max_responses=3, max_age=60, clock=clock)
    for n in range(5):
        store.put(stored(n))
        clock.now += 1
    assert len(store) == 3
    assert store.get("resp_0") is None and store.get("resp_1") is None
    assert [store.get(f"resp_{n}") is not None for n in (2, 3, 4)] == [True, True, True]
    # storing an id again renews it: it becomes the newest
    store.put(stored(2))
    store.put(stored(5))
    assert "resp_3" not in store and "resp_2" in store and "resp_5" in store


def test_store_forgets_what_is_older_than_its_age() -> None:
    clock = Clock()
    store = ResponseStore(max_responses=10, max_age=60, clock=clock)
    store.put(stored(1))
    clock.now += 30
    store.put(stored(2))
    clock.now += 29.9
    assert store.get("resp_1") is not None
    clock.now += 0.1  # resp_1 is 60 s old
    assert store.get("resp_1") is None and store.get("resp_2") is not None
    assert len(store) == 1
    clock.now += 30
    assert store.purge() == 1 and len(store) == 0


def test_store_delete_and_conversation() -> None:
    store = ResponseStore(clock=Clock())
    store.put(stored(1))
    got = store.get("resp_1")
    assert got is not None and got.id == "resp_1"
    assert got.conversation == ({"id": "in_1"}, {"id": "msg_1"})
    assert store.delete("resp_1") and not store.delete("resp_1") and store.get("resp_1") is None
    assert 5 not in store


def test_store_of_size_zero_keeps_nothing_and_bad_limits_raise() -> None:
    store = ResponseStore(max_responses=0)
    store.put(stored(1))
    assert len(store) == 0 and store.get("resp_1") is None
    with pytest.raises(ValueError):
        ResponseStore(max_responses=-1)
    with pytest.raises(ValueError):
        ResponseStore(max_age=0)


# -- hosted and namespace tools ---------------------------------------------------------

SPAWN = {"type": "function", "name": "spawn", "description": "Start an agent",
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Agents",
             "tools": [SPAWN, {**SPAWN, "name": "wait"}]}


def test_hosted_tools_are_skipped_and_namespaces_flattened() -> None:
    call = api.parse({"input": "x", "tools": [
        TOOL, NAMESPACE, {"type": "web_search", "external_web_access": False},
        {"type": "image_generation"}, {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}]})
    assert [t["function"]["name"] for t in call.chat.tools or ()] == [
        "get_weather", "multi_agent_v1__spawn", "multi_agent_v1__wait"]
    assert call.chat.tools and call.chat.tools[1]["function"]["description"] == "Start an agent"
    assert call.chat.skipped_tools == ("web_search", "image_generation", "custom")
    assert call.tool_name("multi_agent_v1__wait") == ("wait", "multi_agent_v1")
    assert call.tool_name("get_weather") == ("get_weather", None)
    echo = dict(call.settings)["tools"]
    assert [t["type"] for t in echo] == ["function", "namespace", "web_search", "image_generation",
                                        "web_search", "custom"]
    assert [t["name"] for t in echo[1]["tools"]] == ["spawn", "wait"]
    # only hosted tools: nothing is offered, nothing forced
    alone = api.parse({"input": "x", "tools": [{"type": "web_search_preview"}],
                       "tool_choice": {"type": "web_search_preview"}})
    assert not alone.chat.tools and alone.chat.tool_choice == "none"
    assert alone.chat.skipped_tools == ("web_search_preview",)
    assert api.parse({"input": "x", "tools": [TOOL]}).chat.skipped_tools == ()


def test_namespace_tool_choice_and_bad_namespaces() -> None:
    call = api.parse({"input": "x", "tools": [NAMESPACE],
                      "tool_choice": {"type": "function", "name": "spawn", "namespace": "multi_agent_v1"}})
    assert call.chat.tool_choice == {"type": "function", "function": {"name": "multi_agent_v1__spawn"}}
    assert dict(call.settings)["tool_choice"] == {"type": "function", "name": "spawn",
                                                  "namespace": "multi_agent_v1"}
    for tools, param in [
        ([{"type": "namespace", "tools": [SPAWN]}], "tools[0].name"),
        ([{"type": "namespace", "name": "n", "tools": "x"}], "tools[0].tools"),
        ([{"type": "namespace", "name": "n", "tools": [{"type": "sorcery"}]}], "tools[0].tools[0].type"),
        ([{**SPAWN, "name": "n__spawn"}, {"type": "namespace", "name": "n", "tools": [SPAWN]}],
         "tools[1].tools[0].name"),
    ]:
        with pytest.raises(RequestError) as e:
            api.parse({"input": "x", "tools": tools})
        assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)


def test_a_namespaced_call_goes_out_with_its_namespace_and_comes_back_joined() -> None:
    w = writer({"input": "x", "tools": [NAMESPACE]})
    out = run(w, [ToolCallDelta(0, '{"task": "t"}', "call_a", "multi_agent_v1__spawn")],
              [Finish("tool_calls"), Usage(3, 3)])
    added = next(e["item"] for e in out if e["type"] == "response.output_item.added")
    assert (added["name"], added["namespace"]) == ("spawn", "multi_agent_v1")
    done = w.response["output"][0]
    assert done["type"] == "function_call" and (done["name"], done["namespace"]) == ("spawn", "multi_agent_v1")
    # the client sends the call back as it got it: the model sees the name it called
    follow = api.parse({"input": [{"role": "user", "content": "x"}, done,
                                  {"type": "function_call_output", "call_id": "call_a", "output": "ok"}],
                        "tools": [NAMESPACE]})
    assert follow.chat.messages[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn"


def test_the_flat_name_is_codexs() -> None:
    """codex-rs joins with ``__`` and trims the underscores next to it; so does afm."""
    call = api.parse({"input": "x", "tools": [{"type": "namespace", "name": "mcp__srv_",
                                               "tools": [{**SPAWN, "name": "_go"}]}]})
    assert [t["function"]["name"] for t in call.chat.tools or ()] == ["mcp__srv__go"]
    assert call.tool_name("mcp__srv__go") == ("_go", "mcp__srv_")


def test_keepalives_anywhere_leave_the_sdk_accumulator_exact() -> None:
    """``response.in_progress`` as the keepalive, before any item and between deltas of a
    message and of a call: the SDK's stream accumulator (which replaces its items by the
    event's snapshot) ends with the same Response as without keepalives."""
    body = {"input": "x", "tools": [NAMESPACE, TOOL], "stream": True}
    steps = [[ContentDelta("Hel")], [ContentDelta("lo")],
             [ToolCallDelta(0, '{"task"', "call_a", "multi_agent_v1__spawn")], [ToolCallDelta(0, ': "t"}')],
             [Finish("tool_calls"), Usage(3, 4)]]
    finals = []
    for keep in (False, True):
        w = writer(body)
        out = w.start() + (w.keepalive() if keep else [])
        for step in steps:
            out += w.feed(step)
            if keep:
                out += w.keepalive()
        out += w.end()
        for e in out:
            sdk_check(e)
        assert [e["sequence_number"] for e in out] == list(range(len(out)))
        # the opening one, one before the first step and after each but the last (it ended)
        assert types(out).count("response.in_progress") == (6 if keep else 1)
        final = sdk_accumulate(out)
        finals.append(final.model_dump(exclude={"usage"}))
        assert final.output_text == "Hello"
        call = final.output[1]
        assert (call.name, call.namespace, call.arguments) == ("spawn", "multi_agent_v1", '{"task": "t"}')
    assert finals[0] == finals[1]
