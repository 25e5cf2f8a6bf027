"""Prompt-progress events on every wire API (issue 18, part 5): opt-in with
``stream_options.include_progress`` (chat, completions) or the
``X-AFM-Progress: true`` header (all four), through the real SDKs."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from afm_http.testing import running_server

STEP = 16
PROMPT = " ".join(f"word{i}" for i in range(60))  # several prefill chunks of STEP tokens
HEADER = {"X-AFM-Progress": "true"}


async def _frames(h: httpx.AsyncClient, path: str, payload: dict[str, Any],
                  headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    out = []
    async with h.stream("POST", path, json=payload, headers=headers or {}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _check_progress(progress: list[dict[str, Any]]) -> None:
    """Counts grow to the whole prompt, in prefill chunks of at most STEP."""
    assert len(progress) >= 3, progress
    done = [p["processed"] for p in progress]
    total = progress[0]["total"]
    assert done == sorted(done) and done[-1] == total and total > 2 * STEP
    assert all(p["total"] == total and p["cache"] == progress[0]["cache"] for p in progress)
    assert all(b - a <= STEP for a, b in itertools.pairwise(done))
    assert all(set(p) == {"total", "cache", "processed", "time_ms"} for p in progress)


@pytest.fixture
async def server(random_model_dir: Path):
    async with running_server(random_model_dir, prefill_step=STEP, prefix_cache_bytes=0,
                              warmup=False) as (url, engine):
        yield url, engine


async def test_chat_progress_chunks_come_before_the_first_token(server) -> None:
    url, _ = server
    payload = {"messages": [{"role": "user", "content": PROMPT}], "stream": True, "max_tokens": 4,
               "temperature": 0, "stream_options": {"include_progress": True, "include_usage": True}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        frames = await _frames(h, "/v1/chat/completions", payload)
        first_choice = next(i for i, f in enumerate(frames) if f["choices"])
        progress = [f["prompt_progress"] for f in frames if "prompt_progress" in f]
        assert all("prompt_progress" in f and f["choices"] == [] for f in frames[:first_choice])
        assert all(f["object"] == "chat.completion.chunk" for f in frames[:first_choice])
        _check_progress(progress)
        assert progress[-1]["total"] == frames[-1]["usage"]["prompt_tokens"]
        # the header asks for it too; without either, none
        frames = await _frames(h, "/v1/chat/completions",
                               {**payload, "stream_options": {"include_usage": True}}, HEADER)
        _check_progress([f["prompt_progress"] for f in frames if "prompt_progress" in f])
        frames = await _frames(h, "/v1/chat/completions", {**payload, "stream_options": None})
        assert not any("prompt_progress" in f for f in frames)
        frames = await _frames(h, "/v1/chat/completions", payload, {"X-AFM-Progress": "false"})
        assert any("prompt_progress" in f for f in frames)  # the body's opt-in stands


async def test_the_openai_sdk_reads_a_stream_with_progress(server) -> None:
    url, _ = server
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], stream=True, max_tokens=4,
        temperature=0, stream_options={"include_usage": True}, extra_headers=HEADER)
    progress, text, finish = [], "", None
    async for chunk in stream:
        extra = chunk.model_extra or {}
        if "prompt_progress" in extra:
            progress.append(extra["prompt_progress"])
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    _check_progress(progress)
    assert finish == "length"
    async with client.chat.completions.stream(
            model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0,
            extra_headers=HEADER) as helper:
        async for _ in helper:
            pass
        snapshot = helper.current_completion_snapshot  # (get_final_completion refuses "length")
    assert snapshot.choices[0].message.content == text
    await client.close()


async def test_completions_progress_and_echo(server) -> None:
    url, _ = server
    payload = {"model": "m", "prompt": PROMPT, "stream": True, "max_tokens": 3, "temperature": 0,
               "echo": True, "logprobs": 1, "stream_options": {"include_progress": True}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        frames = await _frames(h, "/v1/completions", payload)
        first_choice = next(i for i, f in enumerate(frames) if f["choices"])
        assert all(f["object"] == "text_completion" for f in frames)
        _check_progress([f["prompt_progress"] for f in frames[:first_choice]])
        assert not any("prompt_progress" in f for f in frames[first_choice:])
        echo = frames[first_choice]["choices"][0]
        # the echo still carries the prompt's scores (they come after the prefill)
        assert echo["text"] == PROMPT and len(echo["logprobs"]["tokens"]) > 2 * STEP


async def test_anthropic_progress_events_and_the_sdk(server) -> None:
    url, _ = server
    payload = {"model": "m", "max_tokens": 4, "stream": True, "temperature": 0,
               "messages": [{"role": "user", "content": PROMPT}]}
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        names, datas = [], []
        async with h.stream("POST", "/v1/messages", json=payload, headers=HEADER) as r:
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    names.append(line[7:])
                elif line.startswith("data: "):
                    datas.append(json.loads(line[6:]))
        progress = [d["prompt_progress"] for d in datas if d["type"] == "prompt_progress"]
        _check_progress(progress)
        assert names[0] == "message_start" and names[-1] == "message_stop"
        assert names.index("content_block_start") > max(i for i, n in enumerate(names) if n == "prompt_progress")
    client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
    async with client.messages.stream(model="m", max_tokens=4,
                                      messages=[{"role": "user", "content": PROMPT}],
                                      extra_body={"temperature": 0}, extra_headers=HEADER) as stream:
        kinds = [event.type async for event in stream]
        message = await stream.get_final_message()
    assert "prompt_progress" in kinds and message.stop_reason == "max_tokens"
    await client.close()


async def test_responses_progress_events_and_the_sdk(server) -> None:
    url, _ = server
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    events = []
    async with client.responses.stream(model="m", input=PROMPT, max_output_tokens=4, temperature=0,
                                       store=False, extra_headers=HEADER) as stream:
        async for event in stream:
            events.append(event)
    final = events[-1].response  # response.incomplete (max_output_tokens), not completed
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    progress = [e.model_extra["prompt_progress"] for e in events if e.type == "response.prompt_progress"]
    _check_progress(progress)
    assert kinds.index("response.output_item.added") > kinds.index("response.prompt_progress")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.status == "incomplete" and final.usage.input_tokens == progress[-1]["total"]
    await client.close()


async def test_bad_progress_options_are_400s(server) -> None:
    url, _ = server
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        r = await h.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_progress": "yes"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_progress"
        r = await h.post("/v1/completions", json={"prompt": "hi", "stream": True,
                                                  "stream_options": {"include_progress": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_progress"
        r = await h.post("/v1/messages", headers={"X-AFM-Progress": "maybe"}, json={
            "model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert "X-AFM-Progress" in r.json()["error"]["message"]
