"""End-to-end behaviours beyond the basic lifecycle: real hypercorn on 127.0.0.1.

Generation faults, non-streaming cancel and disconnect, the random model,
logprobs, reasoning-first streams, three tool calls, the models routes.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import trio

from afm_core._stream.pipeline import StreamPipeline
from afm_http.testing import running_server
from tests.http.helpers import CHAT, body, sse, text_of


async def wait_idle(engine) -> None:
    """Until no request is open and the generation thread has freed every slot
    (it applies a cancel at its next step, after the Trio side has let go)."""
    with trio.fail_after(20):
        while (s := engine.statistics()).requests_active or s.running or s.waiting:
            await trio.sleep(0.01)


async def test_generation_fault_is_an_error_chunk_then_done(
        echo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import afm_core._engine.prepare as prepare

    class Broken(StreamPipeline):  # a compiled class: subclass it rather than patch it
        def finish(self, out: list) -> None:
            raise RuntimeError("injected fault")

    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        monkeypatch.setattr(prepare, "StreamPipeline", Broken)
        r, events, raw = await sse(c, body("before the fault", stream=True,
                                           stream_options={"include_usage": True}))
        assert r.status_code == 200 and raw[-1] == "[DONE]"
        assert text_of(events, "content") == "before the fault"
        err = events[-1]
        assert err["choices"] == [] and "injected fault" in err["error"]["message"]
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events)
        # non-streaming: the same failure is an HTTP error with the envelope
        r = await c.post(CHAT, json=body("fault"))
        assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "sdk fault"}], stream=True)
        with pytest.raises(openai.APIError, match="injected fault"):
            async for _ in stream:
                pass
        monkeypatch.undo()
        ok = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "healthy again"}])
        assert ok.choices[0].message.content == "healthy again"
        await client.close()
        await wait_idle(engine)


async def test_non_streaming_cancel_by_id(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        result: dict = {}

        async def complete() -> None:
            r = await c.post(CHAT, json=body("word " * 3000), headers={"X-Request-ID": "slow-1"})
            result.update(status=r.status_code, data=r.json(), rid=r.headers["x-request-id"])

        async with trio.open_nursery() as n:
            n.start_soon(complete)
            with trio.fail_after(20):
                while engine.statistics().generation_tokens < 5:
                    await trio.sleep(0.01)
            r = await c.post(f"{CHAT}/slow-1/cancel")
            assert r.status_code == 200 and r.json()["cancelled"] is True
        assert result["status"] == 200 and result["rid"] == "slow-1"
        choice = result["data"]["choices"][0]
        assert choice["finish_reason"] == "cancelled"
        assert ("word " * 3000).startswith(choice["message"]["content"])
        assert (await c.post(f"{CHAT}/slow-1/cancel")).status_code == 404
        assert (await c.post(f"{CHAT}/bad%20id/cancel")).json()["cancelled"] is False


async def test_non_streaming_disconnect_frees_the_slot(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        async with httpx.AsyncClient(base_url=url) as c, trio.open_nursery() as n:
            n.start_soon(lambda: c.post(CHAT, json=body("word " * 5000)))
            with trio.fail_after(20):
                while engine.statistics().generation_tokens < 5:
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()  # the client goes away mid-generation
        await wait_idle(engine)
        assert engine.statistics().running == 0
        assert engine.statistics().generation_tokens < 5000


async def test_random_model_stream_and_sdk(random_model_dir: Path) -> None:
    async with running_server(random_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        payload = body("hello there", stream=True, max_tokens=6, temperature=0,
                       stream_options={"include_usage": True})
        _, events, raw = await sse(c, payload)
        assert raw[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
        finish, usage = events[-2]["choices"][0]["finish_reason"], events[-1]["usage"]
        assert finish in ("length", "stop") and 1 <= usage["completion_tokens"] <= 6
        if finish == "length":
            assert usage["completion_tokens"] == 6
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        resp = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello there"}], max_tokens=6,
            temperature=0)
        assert resp.choices[0].finish_reason == finish
        assert resp.choices[0].message.content == text_of(events, "content")
        assert resp.usage is not None and resp.usage.completion_tokens == usage["completion_tokens"]
        await client.close()
        await wait_idle(engine)


async def test_logprobs_and_reasoning_first(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        _, events, _ = await sse(c, body("<think>plan</think>ok", stream=True, logprobs=True,
                                         top_logprobs=2))
        first = events[0]["choices"][0]["delta"]
        assert first["role"] == "assistant" and "content" not in first
        assert text_of(events, "reasoning_content") == "plan" and text_of(events, "content") == "ok"
        entries = [t for e in events if e.get("choices") and e["choices"][0]["logprobs"]
                   for t in e["choices"][0]["logprobs"]["content"]]
        assert entries and all(-9999.0 <= t["logprob"] <= 0 and len(t["top_logprobs"]) <= 2
                               for t in entries)
        r = await c.post(CHAT, json=body("<think>plan</think>ok"))
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] == "ok" and msg["reasoning_content"] == "plan"


async def test_three_tool_calls_fragments_by_index(echo_model_dir: Path) -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("alpha", "beta", "gamma")]
    calls = [("alpha", {"text": "a longer argument " * 3}), ("beta", {"n": [1, 2, 3]}), ("gamma", {})]
    said = "Plan." + "".join(
        f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        _, events, raw = await sse(c, body(said, stream=True, tools=tools))
        frags = [tc for e in events if e.get("choices")
                 for tc in e["choices"][0]["delta"].get("tool_calls") or []]
        state: dict[int, dict] = {}
        for f in frags:  # the client algorithm of the contract
            s = state.setdefault(f["index"], {"id": None, "name": None, "args": "", "n": 0})
            s["id"] = s["id"] or f.get("id")
            s["name"] = s["name"] or f.get("function", {}).get("name")
            s["args"] += f.get("function", {}).get("arguments") or ""
            s["n"] += 1
        assert sorted(state) == [0, 1, 2]
        assert [state[i]["name"] for i in range(3)] == ["alpha", "beta", "gamma"]
        assert [json.loads(state[i]["args"]) for i in range(3)] == [a for _, a in calls]
        assert len({state[i]["id"] for i in range(3)}) == 3
        assert state[0]["n"] > 2  # the arguments really arrive in fragments
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls" and raw[-1] == "[DONE]"
        assert text_of(events, "content") == "Plan."


async def test_models_routes_with_sdk(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        listed = [m async for m in client.models.list()]
        assert [m.id for m in listed] == [engine.model_id]
        card = await client.models.retrieve(engine.model_id)
        assert card.id == engine.model_id and card.model_extra["context_length"] == 32768
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("no-such-model")
        await client.close()


async def test_32_mixed_clients_leave_nothing_behind(echo_model_dir: Path) -> None:
    """Complete, cancelled-by-id, abandoned and non-streaming requests at once."""
    async with running_server(echo_model_dir) as (url, engine), \
            httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=64),
                              timeout=120) as c:
        outcome: dict[int, str] = {}

        async def one(i: int) -> None:
            text = f"client {i} says " + "word " * (150 if i % 4 in (1, 2) else 10)
            rid = f"mix-{i}"
            if i % 4 == 3:
                r = await c.post(CHAT, json=body(text), headers={"X-Request-ID": rid})
                assert r.json()["choices"][0]["message"]["content"] == text
                outcome[i] = "complete"
                return
            events: list = []
            async with c.stream("POST", CHAT, json=body(text, stream=True),
                                headers={"X-Request-ID": rid}) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        outcome.setdefault(i, "done")
                        break
                    events.append(json.loads(line[6:]))
                    if len(events) == 3 and i % 4 == 1:
                        cancel = await c.post(f"{CHAT}/{rid}/cancel")
                        assert cancel.status_code == 200
                    if len(events) == 3 and i % 4 == 2:
                        outcome[i] = "abandoned"
                        return  # leaving the block drops the connection mid-stream
            reason = events[-1]["choices"][0]["finish_reason"]
            if i % 4 == 1:
                assert reason == "cancelled" and text.startswith(text_of(events, "content"))
            else:
                assert reason == "stop" and text_of(events, "content") == text

        async with trio.open_nursery() as n:
            for i in range(32):
                n.start_soon(one, i)
        assert sorted(outcome) == list(range(32))
        await wait_idle(engine)
        stats = engine.statistics()
        assert stats.running == 0 and stats.waiting == 0
        assert stats.finished.get("cancelled", 0) >= 8
        r = await c.post(CHAT, json=body("after the storm"))
        assert r.json()["choices"][0]["message"]["content"] == "after the storm"


async def test_a_body_left_unread_closes_the_connection_openly(echo_model_dir: Path) -> None:
    # hypercorn closes a connection whose request body the app never read; the response
    # must say so, or a client reusing the connection finds it gone (seen in the fuzzer)
    async with running_server(echo_model_dir) as (url, _engine), httpx.AsyncClient(base_url=url) as c:
        r = await c.post(CHAT, json=body("x"), headers={"X-Request-ID": "a" * 300})
        assert r.status_code == 400 and r.headers["connection"] == "close"
        r = await c.post("/v1/nothing-here", json=body("x"))
        assert r.status_code == 404 and r.headers["connection"] == "close"
        # the body was read: the connection stays open for the next request
        r = await c.post(CHAT, content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "close" not in r.headers.get("connection", "")
        r = await c.post(CHAT, json=body("still served"))
        assert r.status_code == 200 and "close" not in r.headers.get("connection", "")
        r = await c.get("/v1/models")  # no body at all
        assert r.status_code == 200 and "close" not in r.headers.get("connection", "")
        for _ in range(20):  # rejected and served requests, back to back on reused connections
            assert (await c.post(CHAT, json=body("x"), headers={"X-Request-ID": "b" * 300})).status_code == 400
            assert (await c.post(CHAT, json=body("ok"))).status_code == 200
