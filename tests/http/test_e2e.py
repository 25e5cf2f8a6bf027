"""End-to-end: a real hypercorn server on 127.0.0.1, httpx and the openai SDK."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import trio

from afm_core import runtime_info
from afm_http import ServerConfig
from afm_http.testing import running_server
from tests.http.helpers import CHAT, body, sse, text_of


async def test_stream_lifecycle_and_headers(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        r, events, raw = await sse(c, body("Two lines\nof text", stream=True,
                                           stream_options={"include_usage": True}),
                                   {"X-Request-ID": "stream-8f31"})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        assert r.headers["x-request-id"] == r.headers["openai-request-id"] == "stream-8f31"
        assert raw[-1] == "[DONE]"
        first = events[0]["choices"][0]
        assert first["delta"]["role"] == "assistant" and first["finish_reason"] is None
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert len({e["id"] for e in events}) == 1
        finish, usage = events[-2], events[-1]
        assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
        assert usage["choices"] == [] and usage["usage"]["total_tokens"] > 0
        assert text_of(events) == "Two lines\nof text"
        # no usage chunk unless asked
        _, events, _ = await sse(c, body("x", stream=True))
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        assert "usage" not in events[-1]


async def test_non_streaming_and_minted_ids(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        r = await c.post(CHAT, json=body("plain"))
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        assert rid and r.headers["openai-request-id"] == rid
        data = r.json()
        assert data["object"] == "chat.completion"
        assert data["choices"][0]["message"] == {"role": "assistant", "content": "plain",
                                                 "reasoning_content": None} or \
            data["choices"][0]["message"]["content"] == "plain"
        assert data["usage"]["completion_tokens"] > 0


async def test_openai_sdk_stream_and_complete(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        resp = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello sdk"}])
        assert resp.choices[0].message.content == "hello sdk"
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "streamed sdk"}], stream=True,
            stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                usage = chunk.usage
        assert "".join(parts) == "streamed sdk"
        assert usage is not None and usage.completion_tokens > 0
        await client.close()


async def test_reasoning_and_json_fence(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        _, events, _ = await sse(c, body("<think>step by step</think>Final.", stream=True))
        assert text_of(events, "reasoning_content") == "step by step"
        assert text_of(events) == "Final."
        # enforced (the default): a JSON object that fits the grammar passes unchanged
        r = await c.post(CHAT, json=body('{"ok":true}', response_format={"type": "json_object"}))
        assert r.json()["choices"][0]["message"]["content"] == '{"ok":true}'
        assert "x-grammar-constraints" not in r.headers
    # sanitize-only (--no-enforce-json-modes): a fenced answer is unfenced
    async with running_server(echo_model_dir, enforce_json_modes=False) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        fenced = '```json\n{"ok": true}\n```'
        r = await c.post(CHAT, json=body(fenced, response_format={"type": "json_object"}))
        content = r.json()["choices"][0]["message"]["content"]
        assert json.loads(content) == {"ok": True}


async def test_cancel_by_id(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        events: list = []
        raw: list = []

        async def consume() -> None:
            async with c.stream("POST", CHAT, json=body("word " * 3000, stream=True),
                                headers={"X-Request-ID": "cancel-me"}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        raw.append(line[6:])
                        if line[6:] != "[DONE]":
                            events.append(json.loads(line[6:]))

        async with trio.open_nursery() as n:
            n.start_soon(consume)
            with trio.fail_after(20):
                while len(events) < 5:
                    await trio.sleep(0.01)
            r = await c.post(f"{CHAT}/cancel-me/cancel")
            assert r.status_code == 200
            assert r.json() == {"id": "cancel-me", "object": "chat.completion.cancellation",
                                "cancelled": True}
        assert events[-1]["choices"][0]["finish_reason"] == "cancelled"
        assert raw[-1] == "[DONE]"
        r = await c.post(f"{CHAT}/cancel-me/cancel")
        assert r.status_code == 404 and r.json()["cancelled"] is False
        r = await c.post(f"{CHAT}/never-existed/cancel")
        assert r.status_code == 404
        assert engine.statistics().running == 0


async def test_duplicate_id_is_409(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        async with c.stream("POST", CHAT, json=body("word " * 2000, stream=True),
                            headers={"X-Request-ID": "dup"}) as r1:
            lines = r1.aiter_lines()  # kept alive: a dropped iterator closes the connection
            await lines.__anext__()
            r2 = await c.post(CHAT, json=body("x"), headers={"X-Request-ID": "dup"})
            assert r2.status_code == 409
            assert r2.json()["error"]["code"] == "duplicate_request_id"
            assert (await c.post(f"{CHAT}/dup/cancel")).status_code == 200


async def test_profile_events(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        _, events, raw = await sse(c, body("profile", stream=True, stream_options={"include_usage": True}),
                                   {"X-AFM-Profile": "true"})
        assert "usage" in events[-2] and "afm_profile" in events[-1]
        assert "choices" not in events[-1] and raw[-1] == "[DONE]"
        _, events, _ = await sse(c, body("profile", stream=True), {"X-AFM-Profile": "extended"})
        ext = events[-1]["afm_profile_extended"]
        assert set(ext) == {"summary", "samples"}
        r = await c.post(CHAT, json=body("profile"), headers={"X-AFM-Profile": "true"})
        assert "afm_profile" in r.json()
        r = await c.post(CHAT, json=body("profile"), headers={"X-AFM-Profile": "bogus"})
        assert r.status_code == 400


@pytest.mark.parametrize(
    "payload,status",
    [
        (b"{not json", 400),
        (b"[]", 400),
        (b'{"messages": []}', 400),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400),
        (b'{"messages": [{"role": "user", "content": 5}]}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999999}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 17}', 400),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', 400),
        (b"\xff\xfe", 400),
        (b"[" * 5000 + b"]" * 5000, 400),
    ],
)
async def test_bad_requests_get_envelopes(echo_model_dir: Path, payload: bytes, status: int) -> None:
    async with running_server(echo_model_dir, ) as (url, _), httpx.AsyncClient(base_url=url) as c:
        r = await c.post(CHAT, content=payload, headers={"Content-Type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert r.headers["x-request-id"]
        ok = await c.post(CHAT, json=body("still fine"))
        assert ok.json()["choices"][0]["message"]["content"] == "still fine"


async def test_routes_auth_limits_and_ids(echo_model_dir: Path) -> None:
    cfg = ServerConfig(api_key="s3cret", max_body_bytes=2000)
    async with running_server(echo_model_dir, server=cfg) as (url, _), httpx.AsyncClient(base_url=url) as c:
        health = await c.get("/health")
        info = runtime_info()
        assert health.status_code == 200 and health.json()["blas"] == info.blas
        assert health.json()["quantized_kernel"] == info.quantized_kernel  # None: MLX's kernel
        assert health.json()["compiled"] == info.compiled
        assert list(health.json()) == ["status", "model", "running", "waiting", "requests_active",
                                       "inflight", "draining", "error", "blas", "quantized_kernel",
                                       "compiled"]
        assert health.json()["error"] is None and health.json()["draining"] is None
        for path in ("/v1/models", "/metrics"):
            r = await c.get(path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await c.post(CHAT, json=body("x"), headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        r = await c.get("/v1/models", headers=auth)
        assert r.json()["data"][0]["context_length"] == 32768
        r = await c.post(CHAT, json=body("y" * 5000), headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = await c.get("/nope", headers=auth)
        assert r.status_code == 404 and "error" in r.json()
        r = await c.get(CHAT, headers=auth)
        assert r.status_code == 405
        r = await c.post(CHAT, json=body("x"), headers={**auth, "X-Request-ID": "bad id\twith tab"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-ID"
        assert r.headers["x-request-id"] != "bad id\twith tab"
        metrics = (await c.get("/metrics", headers=auth)).text
        assert "afm_requests_running" in metrics and "afm_time_to_first_token_seconds_count" in metrics
        assert "Access-Control-Allow-Origin" not in r.headers


async def test_busy_is_503_with_retry_after(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir, max_batch=1, max_waiting=0) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        async with c.stream("POST", CHAT, json=body("word " * 2000, stream=True),
                            headers={"X-Request-ID": "hog"}) as r1:
            lines = r1.aiter_lines()  # kept alive: a dropped iterator closes the connection
            await lines.__anext__()
            r2 = await c.post(CHAT, json=body("x"))
            assert r2.status_code == 503 and int(r2.headers["retry-after"]) >= 1
            assert r2.json()["error"]["code"] == "engine_busy"
            assert (await c.post(f"{CHAT}/hog/cancel")).status_code == 200
        ok = await c.post(CHAT, json=body("served again"))
        assert ok.json()["choices"][0]["message"]["content"] == "served again"


async def test_client_disconnect_frees_slot(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        async with httpx.AsyncClient(base_url=url) as c:
            async with c.stream("POST", CHAT, json=body("word " * 5000, stream=True)) as r:
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if n > 10:
                        break
        with trio.fail_after(10):
            while engine.statistics().running or engine.statistics().requests_active:
                await trio.sleep(0.01)
        abandoned = engine.statistics()
        assert abandoned.generation_tokens < 5000  # it did not run to its end
        # the abandoned stream left the batch: while a probe request runs to its end, the
        # probe's tokens are all the engine generates (a stream still decoding would add its own)
        async with httpx.AsyncClient(base_url=url) as c:
            probe = (await c.post(CHAT, json=body("probe " * 20))).json()
        after = engine.statistics()
        assert probe["choices"][0]["finish_reason"] == "stop"
        assert after.generation_tokens - abandoned.generation_tokens == \
            probe["usage"]["completion_tokens"] > 0
        assert after.running == after.requests_active == 0
        assert after.finished == {**abandoned.finished, "stop": abandoned.finished.get("stop", 0) + 1}


async def test_32_concurrent_streams(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), \
            httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=64)) as c:
        results: dict[int, str] = {}

        async def one(i: int) -> None:
            _, events, raw = await sse(c, body(f"stream number {i} " * (1 + i % 5), stream=True))
            assert raw[-1] == "[DONE]"
            results[i] = text_of(events)

        async with trio.open_nursery() as n:
            for i in range(32):
                n.start_soon(one, i)
        assert all(results[i] == f"stream number {i} " * (1 + i % 5) for i in range(32))
        assert engine.statistics().running == 0


async def test_tool_calls_stream_and_sdk_helper(echo_model_dir: Path) -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_weather", "read_file")]
    said = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>')
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        _, events, _ = await sse(c, body(said, stream=True, tools=tools))
        frags = [tc for e in events if e.get("choices") for tc in e["choices"][0]["delta"].get("tool_calls") or []]
        firsts = [f for f in frags if "id" in f]
        assert [f["index"] for f in firsts] == [0, 1]
        assert all(f["id"].startswith("call_") and f["type"] == "function" for f in firsts)
        args = {}
        for f in frags:
            args[f["index"]] = args.get(f["index"], "") + f["function"]["arguments"]
        assert json.loads(args[0]) == {"city": "Paris"} and json.loads(args[1]) == {"path": "README.md"}
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert text_of(events) == "Checking."
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        async with client.chat.completions.stream(
                model="m", messages=[{"role": "user", "content": said}], tools=tools) as s:
            async for _ in s:
                pass
            final = await s.get_final_completion()
        calls = final.choices[0].message.tool_calls
        assert [tc.function.name for tc in calls] == ["get_weather", "read_file"]
        assert json.loads(calls[1].function.arguments) == {"path": "README.md"}
        resp = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": said}], tools=tools, parallel_tool_calls=False)
        assert len(resp.choices[0].message.tool_calls) == 1
        assert resp.choices[0].finish_reason == "tool_calls"
        await client.close()


async def test_grammar_downgraded_header(echo_model_dir: Path) -> None:
    rf = {"type": "json_schema",
          "json_schema": {"name": "r", "strict": True, "schema": {"type": "object"}}}
    async with running_server(echo_model_dir, grammar=False) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        r, _, raw = await sse(c, body('{"a": 1}', stream=True, response_format=rf))
        assert r.headers["x-grammar-constraints"] == "downgraded" and raw[-1] == "[DONE]"
        r = await c.post(CHAT, json=body('{"a": 1}', response_format=rf))
        assert r.headers["x-grammar-constraints"] == "downgraded"
        assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"a": 1}
        r = await c.post(CHAT, json=body('{"a": 1}'))
        assert "x-grammar-constraints" not in r.headers


async def test_strict_tool_under_auto_through_the_sdk(echo_model_dir: Path) -> None:
    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": params}}]
    said = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    async with running_server(echo_model_dir) as (url, _):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": said}], tools=tools, max_tokens=60,
            parallel_tool_calls=False)  # masked echo tokens sample freely: no second call
        assert "x-grammar-constraints" not in raw.headers
        choice = raw.parse().choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me look.\n"
        (call,) = choice.message.tool_calls
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")  # "Rome" broke the schema
        await client.close()
