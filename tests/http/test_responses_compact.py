"""``POST /v1/responses/compact`` end to end: a real server on the echo model,
driven by the official openai SDK (``client.responses.compact``) and httpx.

The echo model answers with the last user turn, so the summarising turn's
answer is the summarising prompt itself: the compaction item's summary is
exactly :data:`SUMMARY_PROMPT`, and a conversation continued from the
compacted output alone renders that summary as its last user turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from afm_core.api.responses_compact import SUMMARY_PROMPT, decode_summary
from afm_core.api.responses_request import COMPACTED_HEADER
from afm_http.testing import running_server

COMPACT = "/v1/responses/compact"
CONVERSATION: list[Any] = [
    {"role": "user", "content": "list the files"},
    {"type": "function_call", "call_id": "call_1", "name": "shell",
     "arguments": '{"command": ["ls"]}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\nb.txt"},
    {"role": "assistant", "content": "There are two files."},
    {"role": "user", "content": "now read a.txt"},
]


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_sdk_compact_then_continue_from_the_compacted_items(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        compacted = await client.responses.compact(model="m", input=CONVERSATION,
                                                   instructions="You are a coding agent.")
        assert compacted.object == "response.compaction" and compacted.id.startswith("resp_")
        *users, item = compacted.output
        assert [u.model_dump(warnings=False)["content"][0]["text"] for u in users] == [
            "list the files", "now read a.txt"]
        assert all(u.model_dump(warnings=False)["role"] == "user" for u in users)
        assert item.type == "compaction" and item.id.startswith("cmp_")
        summary = decode_summary(item.encrypted_content)
        assert summary == SUMMARY_PROMPT  # the echo model's "summary" of the prompt asking for one
        u = compacted.usage
        assert u.input_tokens > 0 and u.output_tokens > 0
        assert u.total_tokens == u.input_tokens + u.output_tokens

        # the client replaces its history with the output and goes on: the compaction item
        # is the summary as a user turn (the echo model's last user turn: echoed back)
        history = [x.model_dump(exclude_none=True, warnings=False) for x in compacted.output]
        resp = await client.responses.create(model="m", input=history)
        assert resp.output_text == COMPACTED_HEADER + SUMMARY_PROMPT
        resp = await client.responses.create(model="m", input=[*history,
                                                               {"role": "user", "content": "go on"}])
        assert resp.output_text == "go on"

        # a second compaction: the earlier summary is part of what is summarised
        again = await client.responses.compact(model="m", input=[*history,
                                                                 {"role": "user", "content": "more"}])
        assert [x.type for x in again.output] == ["message", "message", "message", "compaction"]
        await client.close()


async def test_string_input_and_previous_response_id(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        compacted = await client.responses.compact(model="m", input="just one message")
        (user, item) = compacted.output
        assert user.model_dump(warnings=False)["content"][0]["text"] == "just one message"
        assert decode_summary(item.encrypted_content) == SUMMARY_PROMPT

        first = await client.responses.create(model="m", input="remember this")
        compacted = await client.responses.compact(model="m", previous_response_id=first.id)
        assert [x.type for x in compacted.output] == ["message", "compaction"]
        assert compacted.output[0].model_dump(warnings=False)["content"][0]["text"] == "remember this"
        await client.close()


@pytest.mark.parametrize(("body", "param", "status"), [
    ({"model": "m"}, "input", 400),
    ({"model": "m", "input": []}, "input", 400),
    ({"model": "m", "input": 5}, "input", 400),
    ({"model": "m", "input": "x", "stream": True}, "stream", 400),
    ({"model": "m", "input": [{"type": "compaction", "encrypted_content": "gAAAAB-openai-blob"}]},
     "input[0].encrypted_content", 400),
    ({"model": "m", "input": [{"type": "compaction", "encrypted_content": "afm-compaction-v1:%%"}]},
     "input[0].encrypted_content", 400),
    ({"model": "m", "input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
     "input[0].call_id", 400),
    ({"model": "m", "input": "x", "previous_response_id": "resp_missing"}, "previous_response_id", 404),
    ({"model": "m", "input": "x", "n": 2}, "n", 400),
    ([1, 2], "body", 400),
])
async def test_bad_bodies_get_the_openai_envelope(echo_model_dir: Path, body: Any, param: str,
                                                  status: int) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        r = await c.post(COMPACT, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["message"]


async def test_sdk_error_and_a_foreign_compaction_item_in_create(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        with pytest.raises(openai.BadRequestError):
            await client.responses.compact(model="m", input=[])
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(model="m", input=[
                {"type": "compaction", "encrypted_content": "opaque"}])
        assert "not made by this server" in str(info.value)
        await client.close()


async def test_a_compaction_trigger_streams_one_compaction_item(echo_model_dir: Path) -> None:
    """Codex's remote compaction v2: ``/v1/responses`` with a final ``compaction_trigger``
    item answers with one ``compaction`` output item (streamed or not)."""
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        tools: Any = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]
        stream = await client.responses.create(
            model="m", input=[*CONVERSATION, {"type": "compaction_trigger"}], tools=tools,
            stream=True, store=False)
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-2:] == ["response.output_item.done", "response.completed"]
        assert set(kinds[3:-2]) == {"response.compaction.compacting"}
        (item,) = events[-1].response.output
        assert item.type == "compaction" and events[-2].item == item
        assert decode_summary(item.encrypted_content) == SUMMARY_PROMPT

        resp = await client.responses.create(model="m", input=[{"role": "user", "content": "hi"},
                                                               {"type": "compaction_trigger"}])
        (item,) = resp.output
        assert item.type == "compaction" and resp.status == "completed"
        # continuing from the compaction item: its summary is the last user turn
        resp = await client.responses.create(model="m", input=[
            {"role": "user", "content": "hi"}, item.model_dump(exclude_none=True)])
        assert resp.output_text == COMPACTED_HEADER + SUMMARY_PROMPT

        with pytest.raises(openai.BadRequestError):
            await client.responses.create(model="m", input=[{"type": "compaction_trigger"},
                                                            {"role": "user", "content": "x"}])
        await client.close()
