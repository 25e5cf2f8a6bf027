"""afm_core.api.anthropic without a model: requests in, engine events in, Anthropic out.

Oracles: the official SDK's own models (every event and message validates
against ``anthropic.types``) and the SDK's stream accumulator, fed our SSE
bytes through an ``httpx2.MockTransport`` (the SDK's HTTP client) (the transport stands in for the
server; the bytes are the translation's): the message it assembles equals
the non-streaming :meth:`MessageStream.message` built from the same events.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import anthropic
import httpx2
import pydantic
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from afm_core import (
    ContentDelta,
    DuplicateRequestError,
    EngineBusyError,
    EngineClosedError,
    Finish,
    GenerationError,
    LogprobsDelta,
    Profile,
    ReasoningDelta,
    RequestError,
    StreamFailure,
    ToolCallDelta,
    UnsupportedError,
    Usage,
)
from afm_core.api.anthropic import (
    MessageStream,
    encode_event,
    error_body,
    error_status,
    error_type,
    parse_count_tokens,
    parse_request,
    prompt_too_long,
    to_chat_request,
)

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)


def base(**kw: Any) -> dict[str, Any]:
    return {"model": "claude-x", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **kw}


# -- requests -----------------------------------------------------------------------


def test_minimal_request() -> None:
    req = parse_request(base())
    assert (req.model, req.stream, req.max_tokens, req.stop_sequences) == ("claude-x", False, 64, ())
    chat = req.chat
    assert chat.messages == ({"role": "user", "content": "hi"},)
    assert (chat.model, chat.max_tokens, chat.stop, chat.tools, chat.tool_choice) == \
        ("claude-x", 64, (), None, "none")
    assert chat.enable_thinking is None and chat.temperature == 1.0
    assert to_chat_request(base()) == chat


def test_system_prompt_sources_merge_first() -> None:
    req = parse_request(base(
        system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Answer in French."}],
        messages=[{"role": "system", "content": "Late rule."},
                  {"role": "user", "content": "hi"},
                  {"role": "system", "content": [{"type": "text", "text": "Another."}]},
                  {"role": "user", "content": "again"}]))
    assert req.chat.messages == (
        {"role": "system", "content": "You are terse.\nAnswer in French.\n\nLate rule.\n\nAnother."},
        {"role": "user", "content": "hi\nagain"},  # consecutive user turns merge
    )
    assert parse_request(base(system="Plain.")).chat.messages[0] == {"role": "system", "content": "Plain."}


def test_a_tool_round_trip_conversation() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "In Paris."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call it.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "clock"}]},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]
    tools = [{"name": "get_weather", "description": "Weather now", "strict": True,
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"name": "get_time", "input_schema": {"type": "object"}, "type": "custom",
              "cache_control": {"type": "ephemeral"}}]
    chat = parse_request(base(messages=messages, tools=tools)).chat
    assert chat.messages == (
        {"role": "user", "content": "Weather?\nIn Paris."},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I should call it.",
         "tool_calls": [
             {"id": "toolu_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "toolu_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "no\nclock", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "And tomorrow?"},
    )
    assert chat.tools == (
        {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "strict": True,
                                          "parameters": tools[0]["input_schema"]}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    )
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls


def test_an_image_in_a_tool_result_is_a_note_not_a_400() -> None:
    """Claude Code's Read returns a picture as an image block: refused, the
    session would be stuck (every later request carries it)."""
    messages = [{"role": "user", "content": "look"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                    {"type": "text", "text": "a.png:"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}]
    chat = parse_request(base(messages=messages, tools=[{"name": "Read", "input_schema": {}}])).chat
    assert chat.messages[2] == {"role": "tool", "tool_call_id": "t", "content":
                                "a.png:\n[image omitted: this model reads text only]\n"
                                "[document omitted: this model reads text only]"}
    # anywhere else, still a 400
    with pytest.raises(UnsupportedError):
        parse_request(base(messages=[{"role": "user", "content": messages[2]["content"][0]["content"]}]))


def test_an_assistant_turn_of_tool_calls_only_has_no_content() -> None:
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]
    chat = parse_request(base(messages=messages, tools=[{"name": "f", "input_schema": {}}])).chat
    assert chat.messages[1]["content"] is None
    assert chat.messages[2] == {"role": "tool", "content": "", "tool_call_id": "t"}
    assert len(chat.messages) == 3  # a turn of tool results only adds no empty user message


@pytest.mark.parametrize("choice,expected,parallel", [
    ({"type": "auto"}, "auto", True),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
    ({"type": "any"}, "required", True),
    ({"type": "tool", "name": "f", "disable_parallel_tool_use": True},
     {"type": "function", "function": {"name": "f"}}, False),
    ({"type": "none"}, "none", True),
])
def test_tool_choice(choice: dict, expected: Any, parallel: bool) -> None:
    chat = parse_request(base(tools=[{"name": "f", "input_schema": {"type": "object"}}],
                              tool_choice=choice)).chat
    assert (chat.tool_choice, chat.parallel_tool_calls) == (expected, parallel)


@pytest.mark.parametrize("thinking,enabled,shown", [
    (None, None, True),
    ({"type": "enabled", "budget_tokens": 1024}, True, True),
    ({"type": "enabled", "budget_tokens": 2000, "display": "omitted"}, True, False),
    ({"type": "adaptive"}, True, True),
    ({"type": "disabled"}, False, True),
])
def test_thinking(thinking: dict | None, enabled: bool | None, shown: bool) -> None:
    req = parse_request(base(max_tokens=4096, thinking=thinking))
    assert (req.chat.enable_thinking, req.show_thinking) == (enabled, shown)


def test_sampling_stops_and_tolerated_fields() -> None:
    req = parse_request(base(temperature=0, top_p=0.5, top_k=40, stop_sequences=["END", "\n\n"],
                             stream=True, metadata={"user_id": "u-1"}, service_tier="auto",
                             context_management={"edits": []}, betas=["x"], cache_control=None,
                             output_config={"effort": "max", "format": {"type": "json_schema",
                                                                        "schema": {"type": "object"}}}))
    chat = req.chat
    assert (chat.temperature, chat.top_p, chat.top_k) == (0.0, 0.5, 40)
    assert req.stop_sequences == ("END", "\n\n") and chat.stop == ()  # matched by MessageStream
    assert req.stream and chat.stream is False  # the engine streams either way
    assert chat.reasoning_effort == "high"
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "output", "schema": {"type": "object"}, "strict": True}}
    # a max_tokens beyond any context: as much as the context allows
    assert parse_request(base(max_tokens=2**40)).chat.max_tokens is None


def test_count_tokens_request_needs_no_max_tokens() -> None:
    body = base(tools=[{"name": "f", "input_schema": {"type": "object"}}],
                thinking={"type": "enabled", "budget_tokens": 5000})
    del body["max_tokens"]
    chat = parse_count_tokens(body)
    assert chat.max_tokens is None and chat.tools and chat.enable_thinking is True
    with pytest.raises(RequestError, match="model: Field required"):
        parse_count_tokens({"messages": [{"role": "user", "content": "x"}]})


BAD: list[tuple[Any, str]] = [
    ([], "the request body must be a JSON object"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model: Field required"),
    (base(model=3), "model: Input should be a valid string"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
    (base(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
    (base(max_tokens=1.5), "max_tokens: Input should be a valid integer, got a number with a fractional part"),
    (base(max_tokens="5"), "max_tokens: Input should be a valid integer"),
    (base(max_tokens=True), "max_tokens: Input should be a valid integer"),
    (base(messages=None), "messages: Field required"),
    (base(messages={}), "messages: Input should be a valid list"),
    (base(messages=[]), "messages: List should have at least 1 item"),
    (base(messages=["x"]), "messages.0: Input should be a valid dictionary"),
    (base(messages=[{"role": "tool", "content": "x"}]), "messages.0.role: Input should be 'user' or 'assistant'"),
    (base(messages=[{"role": "user"}]), "messages.0.content: Field required"),
    (base(messages=[{"role": "user", "content": 5}]), "messages.0.content: Input should be a valid string or a list"),
    (base(messages=[{"role": "user", "content": [{"text": "x"}]}]), "messages.0.content.0.type: Field required"),
    (base(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
     "messages.0.content.0.text: Input should be a valid string"),
    (base(messages=[{"role": "user", "content": [{"type": "wat"}]}]),
     "messages.0.content.0.type: unknown content block type 'wat'"),
    (base(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]),
     "messages.0.content.0.type: 'tool_use' blocks belong to assistant messages"),
    (base(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]),
     "messages.0.content.0.tool_use_id: Field required"),
    (base(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "y"}]}]),
     "messages.0.content.0.is_error: Input should be a valid boolean"),
    (base(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "content": [{"type": "thinking"}]}]}]),
     "messages.0.content.0.content.0.type: Input tag 'thinking'"),
    (base(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                                                           "name": "f", "input": []}]},
                    {"role": "user", "content": "y"}]), "messages.1.content.0.input: Input should be a valid dictionary"),
    (base(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "tool_result"}]},
                    {"role": "user", "content": "y"}]),
     "messages.1.content.0.type: 'tool_result' blocks belong to user messages"),
    (base(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "thinking"}]},
                    {"role": "user", "content": "y"}]), "messages.1.content.0.thinking: Input should be a valid string"),
    (base(messages=[{"role": "system", "content": "only a system prompt"}]),
     "messages: at least one user message is required"),
    (base(system=5), "system: Input should be a valid string or a list"),
    (base(temperature=1.5), "temperature: Input should be less than or equal to 1"),
    (base(temperature=-0.1), "temperature: Input should be greater than or equal to 0"),
    (base(temperature="hot"), "temperature: Input should be a valid number"),
    (base(top_p=2), "top_p: Input should be less than or equal to 1"),
    (base(top_k=-1), "top_k: Input should be greater than or equal to 0"),
    (base(stream="yes"), "stream: Input should be a valid boolean"),
    (base(stop_sequences="END"), "stop_sequences: Input should be a valid list"),
    (base(stop_sequences=[""]), "stop_sequences.0: String should have at least 1 character"),
    (base(stop_sequences=[1]), "stop_sequences.0: Input should be a valid string"),
    (base(stop_sequences=["x"] * 65), "stop_sequences: List should have at most 64 items"),
    (base(metadata=[]), "metadata: Input should be a valid dictionary"),
    (base(metadata={"user_id": 5}), "metadata.user_id: Input should be a valid string"),
    (base(tools={}), "tools: Input should be a valid list"),
    (base(tools=[{"name": "f"}]), "tools.0.input_schema: Field required"),
    (base(tools=[{"input_schema": {}}]), "tools.0.name: Field required"),
    (base(tools=[{"name": "bad name", "input_schema": {}}]), "tools.0.name: String should match pattern"),
    (base(tools=[{"name": "f", "input_schema": []}]), "tools.0.input_schema: Input should be a valid dictionary"),
    (base(tools=[{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]),
     "tools: Tool names must be unique"),
    (base(tools=[{"name": "f", "input_schema": {}, "description": 1}]),
     "tools.0.description: Input should be a valid string"),
    (base(tools=[{"name": "f", "input_schema": {}, "strict": "y"}]), "tools.0.strict: Input should be a valid boolean"),
    (base(tool_choice="auto"), "tool_choice: Input should be a valid dictionary"),
    (base(tool_choice={"type": "sometimes"}), "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'"),
    (base(tool_choice={"type": "any"}), "tool_choice: tool_choice 'any' requires 'tools'"),
    (base(tool_choice={"type": "tool", "name": "g"}, tools=[{"name": "f", "input_schema": {}}]),
     "tool_choice.name: tool 'g' is not in 'tools'"),
    (base(tool_choice={"type": "auto", "disable_parallel_tool_use": 1}),
     "tool_choice.disable_parallel_tool_use: Input should be a valid boolean"),
    (base(thinking={"type": "enabled"}), "thinking.budget_tokens: Field required"),
    (base(thinking={"type": "enabled", "budget_tokens": 100}),
     "thinking.budget_tokens: Input should be greater than or equal to 1024"),
    (base(max_tokens=1024, thinking={"type": "enabled", "budget_tokens": 1024}),
     "thinking.budget_tokens: `max_tokens` must be greater than `thinking.budget_tokens`"),
    (base(thinking={"type": "on"}), "thinking.type: Input should be 'enabled', 'disabled' or 'adaptive'"),
    (base(thinking={"type": "adaptive", "display": "full"}), "thinking.display: Input should be"),
    (base(output_config={"effort": "extreme"}), "output_config.effort: Input should be"),
    (base(output_config={"format": {"type": "yaml"}}), "output_config.format.type: Input should be 'json_schema'"),
    (base(output_config={"format": {"type": "json_schema"}}), "output_config.format.schema: Field required"),
]


@pytest.mark.parametrize("body,message", BAD)
def test_bad_requests_say_what_is_wrong(body: Any, message: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(body)
    assert info.value.status == 400 and type(info.value) is RequestError
    assert info.value.message.startswith(message), info.value.message


@pytest.mark.parametrize("body,message", [
    (base(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages.0.content.0: content block type 'image' is not supported"),
    (base(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "content": [{"type": "search_result"}]}]}]),
     "messages.0.content.0.content.0: content block type 'search_result' is not supported"),
    (base(messages=[{"role": "user", "content": [{"type": "document"}]}]), "messages.0.content.0: content block"),
    (base(system=[{"type": "image"}]), "system.0: content block type 'image' is not supported"),
    (base(tools=[{"type": "computer_20250124", "name": "computer"}]),
     "tools.0.type: tool type 'computer_20250124' is not supported"),
    (base(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is ("}]),
     "messages: the final message must be a user message"),
])
def test_unsupported_requests_are_400s_too(body: Any, message: str) -> None:
    with pytest.raises(UnsupportedError) as info:
        parse_request(body)
    assert info.value.status == 400 and info.value.message.startswith(message), info.value.message


def test_errors() -> None:
    assert error_status(EngineBusyError()) == 529 and error_type(529) == "overloaded_error"
    assert error_status(EngineClosedError("x")) == 503 and error_type(503) == "api_error"
    assert error_status(DuplicateRequestError("x")) == 409 and error_type(409) == "invalid_request_error"
    assert error_status(RequestError("big", status=413)) == 413 and error_type(413) == "request_too_large"
    assert error_status(GenerationError("x")) == 500 and error_type(500) == "api_error"
    for status, kind in [(400, "invalid_request_error"), (401, "authentication_error"),
                         (403, "permission_error"), (404, "not_found_error"), (405, "invalid_request_error"),
                         (429, "rate_limit_error")]:
        assert error_type(status) == kind
    body = error_body("nope", status=404, request_id="req_1")
    assert body == {"type": "error", "error": {"type": "not_found_error", "message": "nope"}, "request_id": "req_1"}
    assert anthropic.types.ErrorResponse.model_validate(body).error.type == "not_found_error"
    err = prompt_too_long(40000, 32768)
    assert err.status == 400 and err.message == "prompt is too long: 40000 tokens > 32768 maximum"


# -- responses ----------------------------------------------------------------------------


def run(writer: MessageStream, *batches: list[object], close: bool = True) -> list[dict[str, Any]]:
    out = writer.start()
    for batch in batches:
        out += writer.feed_many(batch)
    if close:
        out += writer.close()
    for event in out:  # every event is one of the SDK's types, as sent
        if event["type"] == "error":
            assert anthropic.types.ErrorResponse.model_validate(event).error.type == event["error"]["type"]
        elif event["type"] != "ping":
            assert EVENTS.validate_python(event).type == event["type"]
    return out


def shape(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Events without ids: (type, index, delta or block summary)."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if e["type"] == "content_block_start":
            out.append(("start", e["index"], e["content_block"]["type"]))
        elif e["type"] == "content_block_delta":
            d = dict(e["delta"])
            out.append(("delta", e["index"], d.pop("type"), *d.values()))
        elif e["type"] == "content_block_stop":
            out.append(("stop", e["index"]))
        elif e["type"] == "message_delta":
            out.append(("message_delta", e["delta"]["stop_reason"], e["delta"]["stop_sequence"]))
        else:
            out.append((e["type"],))
    return out


def test_text_stream_and_message() -> None:
    w = MessageStream(model="claude-x", input_tokens=12, id="msg_1")
    events = run(w, [ContentDelta("Hel")], [ContentDelta("lo"), ContentDelta(" you"), LogprobsDelta(())],
                 [Finish("stop"), Usage(12, 3, 4), Profile({"x": 1})])
    assert events[0] == {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 12, "output_tokens": 0}}}
    assert shape(events) == [
        ("message_start",), ("ping",), ("start", 0, "text"), ("delta", 0, "text_delta", "Hel"),
        ("delta", 0, "text_delta", "lo you"),  # one engine step: one delta
        ("stop", 0), ("message_delta", "end_turn", None), ("message_stop",)]
    assert events[-2]["usage"] == {"input_tokens": 8, "output_tokens": 3, "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 4}
    message = w.message()
    assert message == {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
                       "content": [{"type": "text", "text": "Hello you"}], "stop_reason": "end_turn",
                       "stop_sequence": None, "usage": events[-2]["usage"]}
    anthropic.types.Message.model_validate(message)
    assert w.ended and w.feed(ContentDelta("late")) == [] and w.close() == []


def test_thinking_then_text() -> None:
    w = MessageStream(model="m")
    events = run(w, [ReasoningDelta("Let me "), ReasoningDelta("see.")], [ContentDelta("\n\n")],
                 [ContentDelta("Yes.")], [Finish("stop"), Usage(5, 6)])
    assert shape(events) == [
        ("message_start",), ("ping",), ("start", 0, "thinking"), ("delta", 0, "thinking_delta", "Let me see."),
        ("stop", 0), ("start", 1, "text"), ("delta", 1, "text_delta", "\n\nYes."), ("stop", 1),
        ("message_delta", "end_turn", None), ("message_stop",)]
    assert events[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert w.message()["content"] == [{"type": "thinking", "thinking": "Let me see.", "signature": ""},
                                      {"type": "text", "text": "\n\nYes."}]
    hidden = MessageStream(model="m", show_thinking=False)
    events = run(hidden, [ReasoningDelta("secret"), ContentDelta("Yes.")], [Finish("stop"), Usage(5, 6)])
    assert ("delta", 0, "thinking_delta", "secret") not in shape(events)
    assert hidden.message()["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}


TOOL_EVENTS: list[list[object]] = [
    [ContentDelta("Checking.")],
    [ContentDelta("\n")],  # layout before a call: never its own text block
    [ToolCallDelta(0, "", "call_abc", "get_weather")],
    [ToolCallDelta(0, '{"ci')],
    [ToolCallDelta(0, 'ty": "Par')],
    [ToolCallDelta(0, 'is"}')],
    [ToolCallDelta(1, "", "call_def", "read_file"), ToolCallDelta(1, '{"path":'), ToolCallDelta(1, ' "a"}')],
    [Finish("tool_calls"), Usage(30, 20)],
]


def test_tool_calls_stream_their_fragments() -> None:
    w = MessageStream(model="m")
    events = run(w, *TOOL_EVENTS)
    assert shape(events) == [
        ("message_start",), ("ping",), ("start", 0, "text"), ("delta", 0, "text_delta", "Checking."),
        ("delta", 0, "text_delta", "\n"), ("stop", 0),
        ("start", 1, "tool_use"),
        ("delta", 1, "input_json_delta", '{"ci'), ("delta", 1, "input_json_delta", 'ty": "Par'),
        ("delta", 1, "input_json_delta", 'is"}'),  # each fragment as it arrived
        ("stop", 1), ("start", 2, "tool_use"), ("delta", 2, "input_json_delta", '{"path": "a"}'), ("stop", 2),
        ("message_delta", "tool_use", None), ("message_stop",)]
    assert events[6]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}
    assert w.message()["content"] == [
        {"type": "text", "text": "Checking.\n"},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_def", "name": "read_file", "input": {"path": "a"}}]
    assert w.message()["stop_reason"] == "tool_use"


def test_whitespace_alone_never_opens_a_text_block() -> None:
    w = MessageStream(model="m")
    events = run(w, [ReasoningDelta("hm")], [ContentDelta("\n\n")], [ToolCallDelta(0, "", "call_1", "f")],
                 [ToolCallDelta(0, "{}")], [ContentDelta(" \n")], [Finish("tool_calls"), Usage(1, 2)])
    assert [e for e in shape(events) if e[0] == "start"] == [("start", 0, "thinking"), ("start", 1, "tool_use")]
    assert w.message()["content"][1]["input"] == {}


def test_malformed_tool_arguments_stream_as_written() -> None:
    w = MessageStream(model="m")
    events = run(w, [ToolCallDelta(0, "", "call_1", "f"), ToolCallDelta(0, '{"a": ')], [Finish("length"), Usage(1, 2)])
    assert ("delta", 0, "input_json_delta", '{"a": ') in shape(events)
    assert w.message()["content"][0]["input"] == {} and w.message()["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("finish,usage,context,reason", [
    ("stop", Usage(10, 5), None, "end_turn"),
    ("length", Usage(10, 5), None, "max_tokens"),
    ("length", Usage(10, 5), 100, "max_tokens"),
    ("length", Usage(95, 5), 100, "model_context_window_exceeded"),
    ("tool_calls", Usage(10, 5), None, "tool_use"),
    ("cancelled", Usage(10, 5), None, "end_turn"),
])
def test_stop_reasons(finish: str, usage: Usage, context: int | None, reason: str) -> None:
    w = MessageStream(model="m", context_length=context)
    events = run(w, [ContentDelta("x")], [Finish(finish), usage])
    assert events[-2]["delta"] == {"stop_reason": reason, "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 5 and w.finish_reason == finish


def test_stop_sequence_across_deltas_asks_the_engine_to_stop() -> None:
    w = MessageStream(model="m", stop_sequences=["STOP", "ST"])
    out = run(w, [ContentDelta("one S")], close=False)
    assert shape(out)[-1] == ("delta", 0, "text_delta", "one ")  # "S" is held: it may begin a stop
    assert not w.stop_requested
    out = w.feed_many([ContentDelta("TOP and more")])
    assert shape(out) == [("stop", 0)] and w.stop_requested
    assert w.stop_sequence == "STOP"  # both start there: the first in the list, as the matcher
    # the engine still sends what it generated before the cancel landed, then its finish
    out = w.feed_many([ContentDelta("ignored"), ToolCallDelta(0, "", "call_1", "f"), ReasoningDelta("no")])
    assert out == []
    out = w.feed_many([ContentDelta("tail"), Finish("cancelled"), Usage(4, 9)])
    assert shape(out) == [("message_delta", "stop_sequence", "STOP"), ("message_stop",)]
    assert not w.stop_requested and w.close() == []
    assert w.message()["content"] == [{"type": "text", "text": "one "}]
    assert (w.message()["stop_reason"], w.message()["stop_sequence"]) == ("stop_sequence", "STOP")


def test_a_held_stop_prefix_is_released() -> None:
    w = MessageStream(model="m", stop_sequences=["</answer>"])
    events = run(w, [ContentDelta("a </ans")], [ToolCallDelta(0, "", "call_1", "f")], [ContentDelta("b </")],
                 [Finish("length"), Usage(1, 1)])
    assert w.message()["content"][0] == {"type": "text", "text": "a </ans"}
    assert w.message()["content"][2] == {"type": "text", "text": "b </"}
    assert w.stop_sequence is None and events[-2]["delta"]["stop_reason"] == "max_tokens"
    # a stop sequence does not apply to thinking
    w = MessageStream(model="m", stop_sequences=["x"])
    run(w, [ReasoningDelta("xxx"), ContentDelta("ab")], [Finish("stop"), Usage(1, 1)])
    assert w.stop_sequence is None and w.message()["content"][0]["thinking"] == "xxx"


texts = st.text(alphabet="abx \n", max_size=40)


@settings(max_examples=300, deadline=None)
@given(text=texts, stops=st.lists(st.text(alphabet="abx\n", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stop_sequences_at_any_split(text: str, stops: list[str], cuts: list[int]) -> None:
    """Oracle: generation stops once the text so far holds a stop sequence; the answer
    is the text before it (the earliest there, the first listed at a tie), for any split."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    w = MessageStream(model="m", stop_sequences=stops)
    run(w, [ContentDelta(p) for p in pieces], [Finish("stop"), Usage(1, 1)])
    want_text, want_stop, seen = text, None, ""
    for piece in pieces:
        seen += piece
        hits = [(seen.find(s), k) for k, s in enumerate(stops) if s in seen]
        if hits:
            at, k = min(hits)
            want_text, want_stop = seen[:at], stops[k]
            break
    got = "".join(b["text"] for b in w.message()["content"])
    assert got == (want_text if want_text.strip() else "")
    assert w.stop_sequence == want_stop
    assert w.message()["stop_reason"] == ("stop_sequence" if want_stop else "end_turn")


def test_failures() -> None:
    w = MessageStream(model="m")
    events = run(w, [ContentDelta("part")], [StreamFailure("the model broke", code="generation_failed")])
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "the model broke"}}
    assert shape(events)[-2] == ("delta", 0, "text_delta", "part")
    with pytest.raises(GenerationError, match="the model broke"):
        w.message()
    w = MessageStream(model="m")
    events = run(w, [ContentDelta("part")])  # the engine closed without a finish
    assert events[-1]["error"]["message"] == "the stream ended before it finished"
    w = MessageStream(model="m")
    events = run(w, [ContentDelta("part"), Finish("stop")])  # a finish without usage
    assert events[-2]["usage"]["output_tokens"] == 0 and events[-1] == {"type": "message_stop"}


def test_sse_framing() -> None:
    event = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "é\n\"x\""}}
    frame = encode_event(event)
    assert frame == b'event: content_block_delta\ndata: ' + json.dumps(
        event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    assert MessageStream.encode([event, {"type": "ping"}]) == frame + b'event: ping\ndata: {"type":"ping"}\n\n'


# -- the SDK reads what the translation writes ---------------------------------------------


def sdk_client(body: bytes) -> anthropic.AsyncAnthropic:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return anthropic.AsyncAnthropic(api_key="x", base_url="http://afm.test", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))


@pytest.mark.parametrize("batches", [
    TOOL_EVENTS,
    [[ReasoningDelta("Think.")], [ContentDelta("Answer "), ContentDelta("here.")], [Finish("stop"), Usage(3, 4, 1)]],
    [[ContentDelta("stopped at X here")], [Finish("cancelled"), Usage(3, 4)]],
])
def test_the_sdk_assembles_the_same_message(batches: list[list[object]]) -> None:
    w = MessageStream(model="claude-x", input_tokens=3, stop_sequences=["X"])
    body = w.encode(run(w, *batches))
    want = w.message()

    async def main() -> None:
        client = sdk_client(body)
        async with client.messages.stream(model="claude-x", max_tokens=10,
                                          messages=[{"role": "user", "content": "x"}]) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert final.model_dump(exclude_none=True) == \
            anthropic.types.Message.model_validate(want).model_dump(exclude_none=True)
        assert text == "".join(b["text"] for b in want["content"] if b["type"] == "text")
        await client.close()

    trio.run(main)


def test_the_sdk_raises_on_an_error_event() -> None:
    w = MessageStream(model="m")
    body = w.encode(run(w, [ContentDelta("part")], [StreamFailure("the model broke")]))

    async def main() -> None:
        client = sdk_client(body)
        with pytest.raises(anthropic.APIStatusError) as info:
            async with client.messages.stream(model="m", max_tokens=10,
                                              messages=[{"role": "user", "content": "x"}]) as stream:
                await stream.get_final_message()
        assert info.value.body == {"type": "error", "error": {"type": "api_error", "message": "the model broke"}}
        await client.close()

    trio.run(main)


def test_typed_client_tools_are_function_tools() -> None:
    req = parse_request(base(tools=[{"type": "bash_20250124", "name": "bash"},
                                    {"type": "text_editor_20250124", "name": "str_replace_editor"}]))
    tools = [t["function"] for t in req.chat.tools or ()]
    assert [t["name"] for t in tools] == ["bash", "str_replace_editor"]
    assert tools[0]["parameters"]["properties"]["command"]["type"] == "string"
    assert "undo_edit" in tools[1]["parameters"]["properties"]["command"]["enum"]
    with pytest.raises(RequestError) as info:
        parse_request(base(tools=[{"type": "bash_20250124", "name": "bash"},
                                  {"name": "bash", "input_schema": {"type": "object"}}]))
    assert "'bash' is repeated" in info.value.message
