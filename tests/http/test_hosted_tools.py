"""Hosted and grouped tool types end to end: a real hypercorn server on 127.0.0.1 with the
echo model (it answers with the last user turn, so a ``<tool_call>`` block in it is the
model's call), driven by httpx and the openai and anthropic SDKs.

Hosted tools afm does not run (``web_search``, Anthropic's ``web_search_20250305`` ...)
are not offered to the model and named in ``X-AFM-Skipped-Tools``; Responses'
``namespace`` tools are offered as ``<namespace>__<name>`` and a call to one goes out
with the client's ``name`` and ``namespace``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from afm_http.testing import running_server

SKIPPED = "X-AFM-Skipped-Tools"
SPAWN_CALL = ('<tool_call>\n{"name": "multi_agent_v1__spawn", "arguments": {"message": "look"}}'
              '\n</tool_call>')

# what codex-cli 0.171 sends to a custom provider with wire_api = "responses" and its
# default features on (trimmed: fewer tools, shorter texts)
CODEX_BODY: dict[str, Any] = {
    "model": "m",
    "instructions": "You are Codex, a coding agent.",
    "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions instructions>sandboxed</permissions instructions>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context>cwd</environment_context>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": SPAWN_CALL}]},
    ],
    "tools": [
        {"type": "function", "name": "shell_command", "description": "Runs a shell command",
         "strict": False, "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                         "required": ["command"], "additionalProperties": False}},
        {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents",
         "tools": [{"type": "function", "name": "spawn", "description": "Spawn an agent", "strict": False,
                    "parameters": {"type": "object", "properties": {"message": {"type": "string"}},
                                   "required": ["message"]}},
                   {"type": "function", "name": "wait", "description": "Wait for agents", "strict": False,
                    "parameters": {"type": "object", "properties": {}}}]},
        {"type": "web_search", "external_web_access": False},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0199a2b4-5c6d-7e8f-9a0b-1c2d3e4f5a6b",
}


async def test_a_codex_shaped_request_is_served(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        events: list[dict[str, Any]] = []
        async with c.stream("POST", "/v1/responses", json=CODEX_BODY) as r:
            assert r.status_code == 200, await r.aread()
            assert r.headers[SKIPPED] == "web_search"
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        assert events[-1]["type"] == "response.completed"
        added = [e["item"] for e in events if e["type"] == "response.output_item.added"
                 and e["item"]["type"] == "function_call"]
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"
                and e["item"]["type"] == "function_call"]
        for item in added + done:
            assert (item["name"], item["namespace"]) == ("spawn", "multi_agent_v1")
        call = done[0]
        assert json.loads(call["arguments"]) == {"message": "look"}
        # the Response echoes the tools as sent
        tools = events[-1]["response"]["tools"]
        assert [t["type"] for t in tools] == ["function", "namespace", "web_search"]
        assert [t["name"] for t in tools[1]["tools"]] == ["spawn", "wait"]

        # the next turn, as Codex sends it (store off: the items themselves)
        follow = {**CODEX_BODY, "stream": False, "input": [
            *CODEX_BODY["input"], call,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "agent started"}]}
        r2 = await c.post("/v1/responses", json=follow)
        assert r2.status_code == 200, r2.text
        assert r2.headers[SKIPPED] == "web_search"
        out = r2.json()["output"]
        assert out[-1]["content"][0]["text"] == "<tool_response>\nagent started\n</tool_response>"

        # no hosted tool: no header
        plain = await c.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert plain.status_code == 200 and SKIPPED not in plain.headers
        # an unknown type is still a 400 naming it
        bad = await c.post("/v1/responses", json={"model": "m", "input": "hi", "tools": [{"type": "sorcery"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].type"


async def test_openai_sdk_sees_its_own_names(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        body = {k: v for k, v in CODEX_BODY.items() if k not in ("stream", "include")}
        raw = await client.responses.with_raw_response.create(**body)
        assert raw.headers[SKIPPED] == "web_search"
        response = raw.parse()
        calls = [o for o in response.output if o.type == "function_call"]
        assert [(c.name, c.namespace) for c in calls] == [("spawn", "multi_agent_v1")]

        types: list[str] = []
        stream = await client.responses.create(**body, stream=True)
        async for event in stream:
            types.append(event.type)
            if event.type == "response.output_item.done" and event.item.type == "function_call":
                assert (event.item.name, event.item.namespace) == ("spawn", "multi_agent_v1")
        assert types[-1] == "response.completed" and "response.function_call_arguments.done" in types

        # chat completions: a custom tool is skipped, the function tool still offered
        chat = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": SPAWN_CALL.replace("multi_agent_v1__spawn", "f")}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                   {"type": "custom", "custom": {"name": "apply_patch"}}])
        assert chat.headers[SKIPPED] == "custom"
        message = chat.parse().choices[0].message
        assert message.tool_calls and message.tool_calls[0].function.name == "f"  # type: ignore[union-attr]
        await client.close()


async def test_anthropic_server_tools_are_skipped(echo_model_dir: Path) -> None:
    said = 'Looking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    async with running_server(echo_model_dir) as (url, _):
        client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        tools: list[Any] = [
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
            {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
            {"type": "code_execution_20250825", "name": "code_execution"},
        ]
        raw = await client.messages.with_raw_response.create(
            model="m", max_tokens=200, tools=tools, messages=[{"role": "user", "content": said}])
        assert raw.headers[SKIPPED] == "web_search_20250305,code_execution_20250825"
        message = await raw.parse()
        assert message.stop_reason == "tool_use"
        use = [b for b in message.content if b.type == "tool_use"]
        assert [(b.name, b.input) for b in use] == [("get_weather", {"city": "Paris"})]
        # Anthropic's typed client tools are offered under their fixed names and inputs
        call = '<tool_call>\n{"name": "str_replace_based_edit_tool", "arguments": {"command": "view", "path": "/a"}}\n</tool_call>'
        typed: list[Any] = [{"type": "bash_20250124", "name": "bash"},
                            {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool",
                             "max_characters": 1000}]
        message = await client.messages.create(model="m", max_tokens=200, tools=typed,
                                               messages=[{"role": "user", "content": call}])
        use = [b for b in message.content if b.type == "tool_use"]
        assert [(b.name, b.input) for b in use] == [("str_replace_based_edit_tool", {"command": "view", "path": "/a"})]
        count = await client.messages.count_tokens(model="m", tools=typed, messages=[{"role": "user", "content": "x"}])
        bare = await client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}])
        assert count.input_tokens > bare.input_tokens + 50  # their schemas are in the prompt
        # a wrong name for a typed tool, and a beta type afm does not serve, are 400s
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "x"}],
                                         tools=[{"type": "bash_20250124", "name": "shell"}])  # type: ignore[typeddict-item]
        assert "tools.0.name" in str(e.value) and "'bash'" in str(e.value)
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "x"}],
                                         tools=[{"type": "computer_20250124", "name": "computer"}])  # type: ignore[list-item]
        assert "computer_20250124" in str(e.value)
        await client.close()


async def test_chat_flattens_namespace_tools(echo_model_dir: Path) -> None:
    """Chat Completions has no namespace type; a client translating from Responses sends
    one anyway: its functions are offered and called as ``<namespace>__<name>``."""
    spawn = {"type": "function", "name": "spawn", "parameters": {"type": "object"}}  # Responses' form
    wait = {"type": "function", "function": {"name": "wait", "parameters": {"type": "object"}}}  # chat's
    tools: list[Any] = [{"type": "namespace", "name": "multi_agent_v1", "description": "agents",
                         "tools": [spawn, wait, {"type": "web_search"}]}]
    async with running_server(echo_model_dir) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": SPAWN_CALL}], tools=tools)
        assert raw.headers[SKIPPED] == "multi_agent_v1.web_search"
        message = raw.parse().choices[0].message
        call = message.tool_calls[0]  # type: ignore[index]
        assert (call.function.name, call.function.arguments) == (  # type: ignore[union-attr]
            "multi_agent_v1__spawn", '{"message": "look"}')
        # the call goes back as the client got it
        follow = await client.chat.completions.create(model="m", tools=tools, messages=[
            {"role": "user", "content": "go"}, message.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.id, "content": "spawned"},
            {"role": "user", "content": "done"}])
        assert follow.choices[0].message.content == "done"
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 tools=[{"type": "namespace", "name": "ns", "tools": [{"type": "mcp"},
                                                         {"type": "nope"}]}])  # type: ignore[list-item]
        assert e.value.param == "tools[0].tools[1]" and "function tools" in e.value.message
        await client.close()
