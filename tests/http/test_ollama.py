"""Ollama's API end to end: a real hypercorn server on 127.0.0.1 and the ``ollama``
PyPI client unmodified (0.6.3, the ``test`` extra's pin), httpx for the raw shapes."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
import trio

from afm_core import open_engine
from afm_http import ServerConfig
from afm_http.testing import running_models, running_server

OLLAMA_CLIENT = "0.6.3"
"""The client version these tests were written against (``pyproject.toml``'s ``test`` extra)."""

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
        '\n</tool_call>')
RAW = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CANCEL = "/v1/chat/completions/{}/cancel"


def client(url: str) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=url)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_the_client_is_the_pinned_one() -> None:
    from importlib.metadata import version

    assert version("ollama") == OLLAMA_CLIENT


def check_timings(r: Any) -> None:
    """Ollama's last object: every duration in nanoseconds, consistent with each other."""
    assert r.done is True
    for name in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(r[name], int) and r[name] >= 0, name
    assert r.total_duration >= r.load_duration + r.prompt_eval_duration + r.eval_duration - 1
    assert r.prompt_eval_count > 0 and r.eval_count > 0


async def test_chat_streamed_and_not(echo_model_dir: Path) -> None:
    text = "Two lines\nof streamed text"
    async with running_server(echo_model_dir) as (url, engine):
        c = client(url)
        r = await c.chat(model="echo", messages=user(text))
        assert r.message.role == "assistant" and r.message.content == text
        assert r.done_reason == "stop" and r.model == "echo"
        check_timings(r)
        assert datetime.fromisoformat(r.created_at.replace("Z", "+00:00")[:26] + "+00:00").tzinfo == UTC
        parts = [p async for p in await c.chat(model="echo", messages=user(text), stream=True)]
        assert "".join(p.message.content for p in parts) == text
        assert all(not p.done for p in parts[:-1]) and parts[-1].done
        last = parts[-1]
        assert last.message.content == "" and last.done_reason == "stop"
        check_timings(last)
        assert last.eval_count == engine.statistics().generation_tokens - r.eval_count
        async with httpx.AsyncClient(base_url=url) as h, \
                h.stream("POST", "/api/chat", json={"model": "echo", "messages": user("hi")}) as s:
            assert s.headers["content-type"] == "application/x-ndjson"  # stream is Ollama's default
            lines = [json.loads(line) async for line in s.aiter_lines()]
        assert lines[-1]["done"] is True and set(lines[0]) == {"model", "created_at", "message", "done"}


async def test_generate_with_system_raw_and_options(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        c = client(url)
        g = await c.generate(model="echo", prompt="generate this", system="You are terse.")
        assert g.response == "generate this" and g.done_reason == "stop"
        check_timings(g)
        raw = await c.generate(model="echo", prompt=RAW.format("raw prompt"), raw=True)
        assert raw.response == "raw prompt"
        parts = [p async for p in await c.generate(model="echo", prompt="streamed here", stream=True)]
        assert "".join(p.response for p in parts) == "streamed here" and parts[-1].done
        cut = await c.generate(model="echo", prompt="a long answer here", options={"num_predict": 3})
        assert cut.done_reason == "length" and cut.eval_count == 3
        stopped = await c.chat(model="echo", messages=user("one, two, three"),
                               options={"stop": [", three"], "temperature": 0, "seed": 7, "top_k": 1})
        assert stopped.message.content == "one, two" and stopped.done_reason == "stop"


async def test_tools_round_trip(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        c = client(url)
        r = await c.chat(model="echo", messages=user(CALL), tools=TOOLS)
        assert r.message.content == "Let me check." and r.done_reason == "stop"
        (call,) = r.message.tool_calls
        assert call.function.name == "get_weather"
        assert call.function.arguments == {"city": "Paris", "days": [1, 2]}  # an object, not a string
        parts = [p async for p in await c.chat(model="echo", messages=user(CALL), tools=TOOLS, stream=True)]
        calls = [tc for p in parts for tc in p.message.tool_calls or ()]
        assert [tc.function.arguments for tc in calls] == [{"city": "Paris", "days": [1, 2]}]
        assert "".join(p.message.content for p in parts) == "Let me check."
        # the assistant's call and the tool's answer go back; the template renders both
        history = [*user(CALL), r.message, {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
                   *user("thanks")]
        again = await c.chat(model="echo", messages=history, tools=TOOLS)
        assert again.message.content == "thanks" and not again.message.tool_calls
        async with httpx.AsyncClient(base_url=url) as h:
            raw = (await h.post("/api/chat", json={"model": "echo", "messages": user(CALL), "tools": TOOLS,
                                                  "stream": False})).json()
        (tc,) = raw["message"]["tool_calls"]
        assert tc["id"].startswith("call_") and tc["function"]["index"] == 0


async def test_format_schema_is_enforced_and_json(echo_model_dir: Path) -> None:
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    async with running_server(echo_model_dir) as (url, _):
        c = client(url)
        # (think=False: thinking on lets the grammar take a reasoning block first, which a
        # sampled echo may open and fill up to num_predict)
        r = await c.chat(model="echo", messages=user('{"city": "Rome"}'), format=schema, think=False,
                         options={"num_predict": 40})
        assert json.loads(r.message.content)["city"] in ("Paris", "Oslo")  # "Rome" broke the schema
        j = await c.generate(model="echo", prompt='{"a":1}', format="json", think=False)
        assert json.loads(j.response) == {"a": 1}
        # "json" is enforced by the grammar, as Ollama does: prose cannot open the answer
        j = await c.generate(model="echo", prompt="no json here", format="json", think=False,
                             options={"num_predict": 30})
        assert j.response.startswith("{") and "no json" not in j.response


async def test_think_and_logprobs(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        c = client(url)
        r = await c.chat(model="echo", messages=user("<think>step by step</think>Done."), think=True)
        assert (r.message.thinking, r.message.content) == ("step by step", "Done.")
        parts = [p async for p in await c.generate(model="echo", prompt="<think>hm</think>Yes.",
                                                   think="high", stream=True)]
        assert "".join(p.thinking or "" for p in parts) == "hm"
        assert "".join(p.response for p in parts) == "Yes."
        lp = await c.generate(model="echo", prompt="abc", logprobs=True, top_logprobs=2)
        assert "".join(e.token for e in lp.logprobs) == "abc"
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in lp.logprobs)


async def test_embed(random_model_dir: Path) -> None:
    async with running_server(random_model_dir) as (url, engine):
        c = client(url)
        r = await c.embed(model="m", input=["first text", "second one"])
        assert len(r.embeddings) == 2 and r.prompt_eval_count > 0
        assert all(abs(sum(x * x for x in v) - 1) < 1e-3 for v in r.embeddings)  # L2-normalized
        short = await c.embed(model="m", input="first text", dimensions=8)
        assert len(short.embeddings[0]) == 8
        assert abs(sum(x * x for x in short.embeddings[0]) - 1) < 1e-3
        legacy = await c.embeddings(model="m", prompt="first text")
        assert legacy.embedding == pytest.approx(r.embeddings[0], abs=1e-5)
        assert (await c.embed(model="m", input=[])).embeddings == []
        long = "word " * (engine.context_length + 10)
        cut = await c.embed(model="m", input=long)  # truncate: Ollama's default
        assert cut.prompt_eval_count == engine.context_length
        with pytest.raises(ollama.ResponseError) as err:
            await c.embed(model="m", input=long, truncate=False)
        assert err.value.status_code == 400 and "exceeds the context length" in err.value.error


async def test_model_routes(echo_model_dir: Path) -> None:
    async with running_models([echo_model_dir], keep_alive=300) as (url, _):
        c = client(url)
        name = echo_model_dir.name
        (tag,) = (await c.list()).models
        assert tag.model == name and tag.size > 0 and len(tag.digest) == 64
        assert tag.details.format == "safetensors" and tag.details.family == "afm_echo"
        assert (await c.ps()).models == []  # nothing loaded yet
        show = await c.show(name)
        assert show.details.family == "afm_echo" and "completion" in show.capabilities
        assert show.modelinfo["general.architecture"] == "afm_echo"
        assert "<|im_start|>" in show.template
        await c.chat(model=name, messages=user("load it"), keep_alive="10m")
        (ps,) = (await c.ps()).models
        assert ps.model == name and ps.context_length > 0
        left = (ps.expires_at - datetime.now(UTC)).total_seconds()
        assert 0 < left <= 600  # this request's keep_alive, not the server's 300 s
        async with httpx.AsyncClient(base_url=url) as h:
            v = (await h.get("/api/version")).json()
            assert v["version"].count(".") == 2 and v["afm_version"]
            unload = (await h.post("/api/generate", json={"model": name, "keep_alive": 0})).json()
            assert unload["done"] is True and unload["done_reason"] == "unload"
        with trio.fail_after(10):
            while (await c.ps()).models:
                await trio.sleep(0.02)
        load = await c.generate(model=name)  # no prompt: load the model
        assert load.done and load.done_reason == "load"
        assert [m.model for m in (await c.ps()).models] == [name]


async def test_bad_input_gets_ollamas_error_shape(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as h:
        cases = [
            ({"messages": user("x")}, "model is required"),
            ({"model": "m", "messages": user("x"), "options": {"temperature": "hot"}},
             'option "temperature" must be of type float32'),
            ({"model": "m", "messages": user("x"), "format": "yaml"}, "invalid format"),
            ({"model": "m", "messages": user("x"), "think": "very"}, "invalid think value"),
            ({"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
            ({"model": "m", "messages": "hello"}, "messages"),
            ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ]
        for body, text in cases:
            r = await h.post("/api/chat", json=body)
            assert r.status_code == 400, body
            assert set(r.json()) == {"error"} and text in r.json()["error"], r.json()
        r = await h.post("/api/generate", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and set(r.json()) == {"error"}
        r = await h.post("/api/generate", content=b'{"model": "m", "prompt": "x"}')  # curl -d's form type
        assert r.status_code == 415 and set(r.json()) == {"error"} and "Content-Type" in r.json()["error"]
        r = await h.post("/api/generate", json={"model": "m", "prompt": "x", "raw": True, "system": "s"})
        assert r.json() == {"error": "raw mode does not support template, system, or context"}
        assert (await h.get("/api/nothing-here")).json() == {"error": "no such route"}
        with pytest.raises(ollama.ResponseError) as err:  # the client raises it with the status
            await client(url).chat(model="m", messages=user("x"), options={"top_p": 7})
        assert err.value.status_code == 400 and err.value.error == "'top_p' must be between 0 and 1"


async def test_unknown_model_is_404(echo_model_dir: Path, random_model_dir: Path) -> None:
    async with running_models([echo_model_dir, random_model_dir]) as (url, _):
        with pytest.raises(ollama.ResponseError) as err:
            await client(url).chat(model="nope", messages=user("x"))
        assert err.value.status_code == 404
        with pytest.raises(ollama.ResponseError) as err:
            await client(url).show("nope")
        assert err.value.status_code == 404 and err.value.error == "model 'nope' not found"


async def test_disconnect_stops_generation(echo_model_dir: Path) -> None:
    payload = {"model": "m", "messages": user("word " * 3000), "options": {"num_predict": 5000}}
    async with running_server(echo_model_dir) as (url, engine):
        async with httpx.AsyncClient(base_url=url) as h, h.stream("POST", "/api/chat", json=payload) as r:
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n > 5:
                    break
        with trio.fail_after(10):
            while engine.statistics().running or engine.statistics().requests_active:
                await trio.sleep(0.01)
        assert engine.statistics().generation_tokens < 3000  # it did not run to its end


async def test_cancel_route_ends_an_ollama_stream(echo_model_dir: Path) -> None:
    payload = {"model": "m", "messages": user("word " * 3000), "options": {"num_predict": 5000}}
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as h:
        async with h.stream("POST", "/api/chat", json=payload, headers={"X-Request-ID": "olla"}) as r:
            lines = []
            async for line in r.aiter_lines():
                lines.append(json.loads(line))
                if len(lines) == 3:
                    assert (await h.post(CANCEL.format("olla"))).status_code == 200
        assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"
        assert lines[-1]["eval_count"] == engine.statistics().generation_tokens < 3000


async def test_served_with_an_api_key(echo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_server(echo_model_dir, server=ServerConfig(api_key="sekret")) as (url, _):
        with pytest.raises(ollama.ResponseError) as err:
            await client(url).chat(model="m", messages=user("x"))
        assert err.value.status_code == 401
        monkeypatch.setenv("OLLAMA_API_KEY", "sekret")  # the client sends it as a bearer token
        assert (await client(url).chat(model="m", messages=user("ok"))).message.content == "ok"


async def test_a_dedicated_embedding_model_answers(echo_model_dir: Path, random_model_dir: Path) -> None:
    async with open_engine(random_model_dir) as embedder, \
            running_server(echo_model_dir, embedder=embedder) as (url, _):
        r = await client(url).embed(model="anything", input="some text")
        assert len(r.embeddings) == 1 and r.model == "anything"
