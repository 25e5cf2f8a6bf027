"""ChatRequest validation: every accepted field, and typed errors with params."""

from __future__ import annotations

from dataclasses import replace

import pytest

from afm_core import ChatRequest, RequestError
from afm_core.api.chat_request import MAX_N

USER = [{"role": "user", "content": "hi"}]


def ok(**kw) -> ChatRequest:
    return ChatRequest.from_openai({"messages": USER, **kw})


def test_defaults_and_fields() -> None:
    r = ok()
    assert (r.temperature, r.top_p, r.max_tokens, r.stream, r.tool_choice) == (1.0, 1.0, None, False, "none")
    r = ok(stream=True, stream_options={"include_usage": True}, max_completion_tokens=7, max_tokens=99,
           temperature=0, top_k=-1, seed=3, stop="END", logit_bias={"5": -100}, logprobs=True,
           top_logprobs=2, reasoning_effort="none", response_format={"type": "json_object"})
    assert r.include_usage and r.max_tokens == 7 and r.temperature == 0.0 and r.top_k == 0
    assert r.stop == ("END",) and r.logit_bias == {5: -100.0} and r.enable_thinking is False
    assert r.response_format == {"type": "json_object"}
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = ok(tools=tools)
    assert r.tool_choice == "auto" and r.tools[0]["function"]["parameters"]["type"] == "object"
    r = ok(tools=tools, tool_choice={"type": "function", "function": {"name": "f"}})
    assert r.tool_choice == {"type": "function", "function": {"name": "f"}}


def test_messages_are_normalised() -> None:
    r = ChatRequest.from_openai({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]})
    assert r.messages[0] == {"role": "system", "content": "ab"}
    assert r.messages[2]["tool_calls"][0]["function"]["name"] == "f"
    assert r.messages[3]["tool_call_id"] == "c1"


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
    ({"messages": USER, "temperature": 3}, "temperature"),
    ({"messages": USER, "temperature": True}, "temperature"),
    ({"messages": USER, "top_p": float("nan")}, "top_p"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_tokens": 2**40}, "max_tokens"),
    ({"messages": USER, "max_tokens": "5"}, "max_tokens"),
    ({"messages": USER, "stop": [""]}, "stop"),
    ({"messages": USER, "stop": ["x"] * 17}, "stop"),
    ({"messages": USER, "logit_bias": {"a": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"1": 500}}, "logit_bias"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "tools": {"f": 1}}, "tools"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
     "tools[1].function.name"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": 1}}},
     "response_format.json_schema.schema"),
    ({"messages": USER, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"messages": USER, "seed": 1.5}, "seed"),
    ({"messages": USER, "reasoning_effort": "max"}, "reasoning_effort"),
    ({"messages": USER, "model": 5}, "model"),
    ([1, 2], "body"),
])
def test_invalid_values_raise_with_param(body, param: str) -> None:
    with pytest.raises(RequestError) as info:
        ChatRequest.from_openai(body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.to_dict()["error"]["message"]


@pytest.mark.parametrize("n", [0, 17, -1, 1.5, "2", True])
def test_n_outside_one_to_sixteen(n: object) -> None:
    with pytest.raises(RequestError) as info:
        ok(n=n)
    assert info.value.param == "n" and info.value.status == 400


def test_n_runs_one_request_per_choice() -> None:
    assert ok().n == 1 and ok().per_choice() == (ok(),)
    r = ok(n=MAX_N, temperature=0.7)
    assert r.n == 16 and ok(n=3.0).n == 3
    choices = r.per_choice()
    assert len(choices) == 16 and all(c == replace(r, n=1) for c in choices)
    # seeded: choice j samples with seed + j (reproducible, and different)
    seeded = ok(n=3, seed=41).per_choice()
    assert [c.seed for c in seeded] == [41, 42, 43] and {c.n for c in seeded} == {1}
    assert [c.seed for c in ok(n=2, seed=-1).per_choice()] == [-1, 0]
