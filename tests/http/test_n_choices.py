"""``n`` > 1 on ``/v1/chat/completions`` end to end: a real hypercorn server on
127.0.0.1, the openai SDK and a strict SSE reader.  The choices run as n engine
streams; their chunks interleave by ``index``; usage counts the prompt once;
cancel ends every choice; a failing choice stops the others.  Also: ``n`` on
completions and the Responses API have the same limit."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from afm_http.testing import running_server
from tests.http.helpers import CHAT, body, sse

N = 3


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def by_index(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each choice's own chunk payloads (``choices[0]``), in order."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        for c in e.get("choices") or ():
            out[c["index"]].append(c)
    return dict(out)


def finishes(events: list[dict[str, Any]]) -> dict[int, str]:
    return {i: cs[-1]["finish_reason"] for i, cs in by_index(events).items() if cs[-1]["finish_reason"]}


def assert_envelope(r: httpx.Response, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


async def idle(engine: Any) -> None:
    with trio.fail_after(10):
        while engine.statistics().running or engine.statistics().requests_active:
            await trio.sleep(0.01)


# -- the openai SDK ----------------------------------------------------------------


async def test_sdk_streams_interleaved_choices_and_one_usage(echo_model_dir: Path) -> None:
    text = "three answers, one prompt"
    async with running_server(echo_model_dir) as (url, engine):
        client = sdk(url)
        one = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": text}], n=N, stream=True,
            stream_options={"include_usage": True})
        parts: dict[int, str] = defaultdict(str)
        done: dict[int, str] = {}
        roles: dict[int, str | None] = {}
        order, usages, ids = [], [], set()
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.usage is not None:
                assert chunk.choices == []
                usages.append(chunk.usage)
            for c in chunk.choices:
                assert c.index not in done, "nothing of a choice follows its finish"
                roles.setdefault(c.index, c.delta.role)
                order.append(c.index)
                parts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    done[c.index] = c.finish_reason
        assert dict(parts) == dict.fromkeys(range(N), text) and done == dict.fromkeys(range(N), "stop")
        assert roles == dict.fromkeys(range(N), "assistant") and len(ids) == 1
        assert order != sorted(order), "the choices interleave"
        (usage,) = usages  # one usage chunk for all: the prompt once, every choice's completion
        assert usage.prompt_tokens == one.usage.prompt_tokens
        assert usage.completion_tokens == N * one.usage.completion_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert engine.statistics().requests_active == 0
        await client.close()


async def test_sdk_non_streaming_has_n_choices(echo_model_dir: Path) -> None:
    text = "a non-streamed echo"
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        one = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                                   logprobs=True, top_logprobs=2)
        resp = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                                    n=N, logprobs=True, top_logprobs=2)
        assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
        assert [c.index for c in resp.choices] == list(range(N))
        assert [c.message.content for c in resp.choices] == [text] * N
        assert {c.finish_reason for c in resp.choices} == {"stop"}
        tokens = [t.token for t in one.choices[0].logprobs.content]
        assert tokens
        for c in resp.choices:  # each choice its own logprobs
            assert [t.token for t in c.logprobs.content] == tokens
            assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        assert resp.usage.prompt_tokens == one.usage.prompt_tokens
        assert resp.usage.completion_tokens == N * one.usage.completion_tokens
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
        # n=1 spelled out is the default
        same = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], n=1)
        assert len(same.choices) == 1 and same.usage.completion_tokens == one.usage.completion_tokens
        await client.close()


async def test_greedy_choices_equal_the_single_answer(random_model_dir: Path) -> None:
    msgs = [{"role": "user", "content": "tell me something"}]
    async with running_server(random_model_dir) as (url, _):
        client = sdk(url)
        one = await client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=12)
        many = await client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=12, n=4)
        assert [c.message.content for c in many.choices] == [one.choices[0].message.content] * 4
        assert [c.finish_reason for c in many.choices] == [one.choices[0].finish_reason] * 4
        await client.close()


async def test_seeded_choices_differ_and_are_reproducible(random_model_dir: Path) -> None:
    msgs = [{"role": "user", "content": "tell me something"}]
    kw: dict[str, Any] = {"model": "m", "messages": msgs, "temperature": 1.0, "max_tokens": 16, "seed": 7}
    async with running_server(random_model_dir) as (url, _):
        client = sdk(url)
        a = await client.chat.completions.create(n=N, **kw)
        b = await client.chat.completions.create(n=N, **kw)
        texts = [c.message.content for c in a.choices]
        assert len(set(texts)) == N, texts  # seed + j per choice: they differ ...
        assert [c.message.content for c in b.choices] == texts  # ... and each is reproducible
        # choice j is the single answer seeded with seed + j
        second = await client.chat.completions.create(**{**kw, "seed": 8})
        assert second.choices[0].message.content == texts[1]
        # streamed, the same answers
        stream = await client.chat.completions.create(n=N, stream=True, **kw)
        parts: dict[int, str] = defaultdict(str)
        async for chunk in stream:
            for c in chunk.choices:
                parts[c.index] += c.delta.content or ""
        assert [parts[i] for i in range(N)] == texts
        await client.close()


async def test_tool_calls_per_choice(echo_model_dir: Path) -> None:
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_weather", "read_file")]
    said = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>')
    msgs = [{"role": "user", "content": said}]
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        _, events, raw = await sse(c, body(said, stream=True, tools=tools, n=2))
        assert raw[-1] == "[DONE]"
        for i, chunks in by_index(events).items():
            assert i in (0, 1)
            frags = [tc for ch in chunks for tc in ch["delta"].get("tool_calls") or []]
            assert [f["index"] for f in frags if "id" in f] == [0, 1]
            args: dict[int, str] = defaultdict(str)
            for f in frags:
                args[f["index"]] += f["function"]["arguments"]
            assert [json.loads(a) for _, a in sorted(args.items())] == [{"city": "Paris"}, {"path": "README.md"}]
            assert "".join(ch["delta"].get("content") or "" for ch in chunks) == "Checking."
        assert finishes(events) == {0: "tool_calls", 1: "tool_calls"}
        client = sdk(url)
        # the SDK's stream helper assembles each choice's calls by index
        async with client.chat.completions.stream(model="m", messages=msgs, tools=tools, n=2) as s:
            async for _ in s:
                pass
            final = await s.get_final_completion()
        assert len(final.choices) == 2
        for choice in final.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
            assert [tc.function.name for tc in choice.message.tool_calls] == ["get_weather", "read_file"]
        resp = await client.chat.completions.create(model="m", messages=msgs, tools=tools, n=2,
                                                    parallel_tool_calls=False)
        assert [len(ch.message.tool_calls) for ch in resp.choices] == [1, 1]
        ids = [ch.message.tool_calls[0].id for ch in resp.choices]
        assert all(i.startswith("call_") for i in ids)
        await client.close()


async def test_structured_output_per_choice(echo_model_dir: Path) -> None:
    fenced = '```json\n{"ok": true}\n```'  # unfenced by the sanitize-only path
    async with running_server(echo_model_dir, enforce_json_modes=False) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        r = await c.post(CHAT, json=body(fenced, response_format={"type": "json_object"}, n=2))
        assert [json.loads(ch["message"]["content"]) for ch in r.json()["choices"]] == [{"ok": True}] * 2
        _, events, _ = await sse(c, body(fenced, response_format={"type": "json_object"}, n=2, stream=True))
        for i in (0, 1):
            text = "".join(ch["delta"].get("content") or "" for ch in by_index(events)[i])
            assert json.loads(text) == {"ok": True}


async def test_profile_is_choice_zeros_after_the_usage(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        _, events, raw = await sse(c, body("profiled", n=2, stream=True, stream_options={"include_usage": True}),
                                   {"X-AFM-Profile": "true"})
        assert [list(e) for e in events if "afm_profile" in e] == [["afm_profile"]]
        assert "afm_profile" in events[-1] and "usage" in events[-2] and raw[-1] == "[DONE]"
        assert finishes(events) == {0: "stop", 1: "stop"}
        r = await c.post(CHAT, json=body("profiled", n=2), headers={"X-AFM-Profile": "true"})
        data = r.json()
        assert "afm_profile" in data and len(data["choices"]) == 2


# -- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 17, -1, "x", 1.5, True, [2]])
async def test_bad_n_is_a_400_envelope(echo_model_dir: Path, n: Any) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        for stream in (False, True):
            assert_envelope(await c.post(CHAT, json=body("x", n=n, stream=stream)), "n")
        client = sdk(url)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 n=n)
        assert info.value.status_code == 400 and info.value.body["param"] == "n"
        await client.close()
        assert engine.statistics().requests_active == 0


async def test_n_limits_on_every_api(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir, max_batch=2, max_waiting=2) as (url, _), \
            httpx.AsyncClient(base_url=url) as c:
        # more choices than the engine takes at once (max_batch + max_waiting)
        err = assert_envelope(await c.post(CHAT, json=body("x", n=5)), "n")
        assert "at most 4" in err["message"]
        assert len((await c.post(CHAT, json=body("four", n=4))).json()["choices"]) == 4
        # the legacy completions share the limit of 16 per prompt
        assert_envelope(await c.post("/v1/completions", json={"prompt": "x", "n": 17}), "n")
        # the Responses API's n extension: the same limits (tests/http/test_responses_n.py)
        assert_envelope(await c.post("/v1/responses", json={"input": "x", "n": 17}), "n")
        err = assert_envelope(await c.post("/v1/responses", json={"input": "x", "n": 5}), "n")
        assert "at most 4" in err["message"]
        r = await c.post("/v1/responses", json={"input": "just one", "n": 1})
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "just one"


# -- cancellation, disconnect, failure ---------------------------------------------


async def test_cancel_ends_every_choice(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        events: list = []
        raw: list = []

        async def consume() -> None:
            async with c.stream("POST", CHAT, json=body("word " * 3000, stream=True, n=N,
                                                        stream_options={"include_usage": True}),
                                headers={"X-Request-ID": "n-cancel-me"}) as r:
                assert r.headers["x-request-id"] == "n-cancel-me"
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        raw.append(line[6:])
                        if line[6:] != "[DONE]":
                            events.append(json.loads(line[6:]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            with trio.fail_after(20):
                while set(by_index(events)) != set(range(N)) or len(events) < 10:
                    await trio.sleep(0.01)
            r = await c.post("/v1/chat/completions/n-cancel-me/cancel")
            assert r.status_code == 200 and r.json()["cancelled"] is True
        assert finishes(events) == dict.fromkeys(range(N), "cancelled")
        assert raw[-1] == "[DONE]" and events[-1]["choices"] == [] and "usage" in events[-1]
        assert (await c.post("/v1/chat/completions/n-cancel-me/cancel")).status_code == 404
        stats = engine.statistics()
        assert stats.running == 0 and stats.requests_active == 0
        assert stats.generation_tokens < N * 3000


async def test_client_disconnect_drops_every_choice(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        async with httpx.AsyncClient(base_url=url) as c:
            async with c.stream("POST", CHAT, json=body("word " * 3000, stream=True, n=N)) as r:
                lines = 0
                async for _ in r.aiter_lines():
                    lines += 1
                    if lines > 10:
                        break
        await idle(engine)
        abandoned = engine.statistics()
        assert abandoned.generation_tokens < N * 3000
        async with httpx.AsyncClient(base_url=url) as c:  # only a new request's tokens from now on
            probe = (await c.post(CHAT, json=body("probe " * 20, max_tokens=100))).json()
        after = engine.statistics()
        assert after.generation_tokens - abandoned.generation_tokens == probe["usage"]["completion_tokens"] > 0


async def test_a_failing_choice_stops_the_others(echo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from afm_core._engine import sampling

    original = sampling.logits_processors

    def processors(req: Any, vocab_size: int) -> list[Any]:
        if req.seed != 666:
            return original(req, vocab_size)
        calls = [0]

        def boom(tokens: Any, logits: Any) -> Any:
            calls[0] += 1
            if calls[0] > 3:
                raise RuntimeError("choice 1 fell over")
            return logits

        return [boom]

    monkeypatch.setattr(sampling, "logits_processors", processors)
    # choice 1 samples with seed 665 + 1
    payload = body("word " * 500, n=2, seed=665, temperature=0.5, max_tokens=2000)
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        _, events, raw = await sse(c, {**payload, "stream": True, "stream_options": {"include_usage": True}})
        assert raw[-1] == "[DONE]" and "choice 1 fell over" in events[-1]["error"]["message"]
        assert events[-1]["choices"] == []
        assert finishes(events) == {} and not any("usage" in e for e in events)
        await idle(engine)
        assert engine.statistics().generation_tokens < 2 * 500
        r = await c.post(CHAT, json=payload)
        assert r.status_code >= 500 and "choice 1 fell over" in r.json()["error"]["message"]
        await idle(engine)
        ok = await c.post(CHAT, json=body("still fine", n=2))
        assert [ch["message"]["content"] for ch in ok.json()["choices"]] == ["still fine"] * 2
