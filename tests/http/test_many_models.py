"""Several models in one server (``afm serve --model A --model B``, ``--models-dir``):
each request reaches its model, models load on first use (one shared load),
unload after their keep-alive or for room under ``--max-loaded-bytes`` (never
while they answer a request), another model's stream flows while one loads,
and an unknown model is a 404 ``model_not_found`` in the API's own envelope.

Real hypercorn servers on loopback, real clients; the orderings are forced
with gates in the engine opener (``running_models(opener=...)``) or by a
request holding a model, never by timings.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import trio

from afm_core import Engine, EngineConfig, open_engine
from afm_core.testing import make_echo_model, make_random_model
from afm_http._registry import ModelSpec, weights_bytes
from afm_http.testing import running_models
from tests.process import LoggedProcess

WAIT = 60  # seconds a test may wait for an event before it fails


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    make_echo_model(root / "echo")
    for i, name in enumerate(("tiny-a", "tiny-b", "tiny-c")):
        make_random_model(root / name, seed=i + 1)
    (root / "notes").mkdir()  # neither a model directory nor a .gguf: not listed
    return root


def m(models_dir: Path, *names: str) -> list[Path]:
    return [models_dir / n for n in names]


def chat(model: str | None, text: str = "hello there", **kw: object) -> dict:
    body: dict = {"messages": [{"role": "user", "content": text}], "max_tokens": 64, **kw}
    if model is not None:
        body["model"] = model
    return body


async def states(c: httpx.AsyncClient) -> dict[str, str]:
    r = await c.get("/v1/models")
    assert r.status_code == 200
    return {card["id"]: card["state"] for card in r.json()["data"]}


async def metric(c: httpx.AsyncClient, name: str, model: str, extra: str = "") -> float:
    text = (await c.get("/metrics")).text
    found = re.search(rf'^{name}{{model="{re.escape(model)}"{extra}}} (\S+)$', text, re.M)
    assert found, f"{name} for {model} not in /metrics"
    return float(found.group(1))


async def until(check, what: str) -> None:  # type: ignore[no-untyped-def]
    """Poll ``check()`` (async, truthy when done) until it holds."""
    with trio.fail_after(WAIT):
        while not await check():
            await trio.sleep(0.02)


async def until_state(c: httpx.AsyncClient, model: str, state: str) -> None:
    async def check() -> bool:
        return (await states(c))[model] == state

    await until(check, f"{model} {state}")


def gated_opener(gates: dict[str, trio.Event], opened: dict[str, int],
                 started: dict[str, trio.Event] | None = None,
                 closing: dict[str, trio.Event] | None = None):  # type: ignore[no-untyped-def]
    """open_engine, counting opens by model name, waiting on ``gates[name]`` before
    loading (``started[name]`` set first) and on ``closing[name]`` before closing."""

    @asynccontextmanager
    async def opener(source: str, config: EngineConfig) -> AsyncIterator[Engine]:
        name = Path(source).name
        opened[name] = opened.get(name, 0) + 1
        if started is not None and name in started:
            started[name].set()
        if name in gates:
            await gates[name].wait()
        async with open_engine(source, config=config) as engine:
            try:
                yield engine
            finally:
                if closing is not None and name in closing:
                    await closing[name].wait()

    return opener


async def test_each_request_reaches_its_model_and_unknown_ones_are_404(models_dir: Path) -> None:
    async with running_models(m(models_dir, "echo", "tiny-a"), warmup=False) as (url, registry), \
            httpx.AsyncClient(base_url=url, timeout=WAIT) as c:
        listed = (await c.get("/v1/models")).json()["data"]
        assert [(d["id"], d["object"], d["owned_by"], d["state"]) for d in listed] == [
            ("echo", "model", "afm", "unloaded"), ("tiny-a", "model", "afm", "unloaded")]
        health = (await c.get("/health")).json()
        assert health["status"] == "ok" and health["models"] == {"echo": "unloaded", "tiny-a": "unloaded"}

        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        text = "the echo model says exactly this"
        echoed = await client.chat.completions.create(model="echo", messages=[{"role": "user", "content": text}])
        assert echoed.choices[0].message.content == text and echoed.model == "echo"
        assert await states(c) == {"echo": "loaded", "tiny-a": "unloaded"}
        other = await client.chat.completions.create(model="tiny-a", max_tokens=8,
                                                      messages=[{"role": "user", "content": text}])
        assert other.model == "tiny-a" and other.choices[0].message.content != text
        assert other.usage.completion_tokens == 8  # random weights: no end of sequence in 8 tokens
        assert await states(c) == {"echo": "loaded", "tiny-a": "loaded"}
        card = (await c.get("/v1/models/tiny-a")).json()
        assert card["state"] == "loaded" and card["context_length"] == 4096

        # every route picks the model the same way
        r = await c.post("/v1/completions", json={"model": "echo", "prompt": "x", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["model"] == "echo"
        r = await c.post("/v1/messages", json={"model": "echo", "max_tokens": 32,
                                               "messages": [{"role": "user", "content": "hi anthropic"}]})
        assert r.status_code == 200 and r.json()["content"][0]["text"] == "hi anthropic"
        response = await client.responses.create(model="echo", input="through the responses api")
        assert response.output_text == "through the responses api" and response.model == "echo"
        r = await c.post("/v1/responses/input_tokens", json={"model": "tiny-a", "input": "Hello"})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        r = await c.post("/tokenize", json={"model": "tiny-a", "content": "Hello"})
        assert r.status_code == 200 and r.json()["tokens"]
        r = await c.post("/v1/chat/completions", json=chat(None, text))  # no model: the first one's
        assert r.json()["choices"][0]["message"]["content"] == text

        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        assert caught.value.code == "model_not_found" and caught.value.param == "model"
        for path, body in (("/v1/chat/completions", chat("nope", stream=True)),
                           ("/v1/completions", {"model": "nope", "prompt": "x"}),
                           ("/v1/responses", {"model": "nope", "input": "x", "stream": True}),
                           ("/v1/responses/input_tokens", {"model": "nope", "input": "x"}),
                           ("/v1/embeddings", {"model": "nope", "input": "x"}),
                           ("/v1/chat/completions/count_tokens", chat("nope"))):
            r = await c.post(path, json=body)
            assert r.status_code == 404, path
            assert r.json()["error"]["code"] == "model_not_found", path
        assert (await c.get("/v1/models/nope")).status_code == 404
        sdk = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as found:
            await sdk.messages.create(model="claude-nope", max_tokens=8,
                                      messages=[{"role": "user", "content": "x"}])
        assert found.value.body["type"] == "error" and found.value.body["error"]["type"] == "not_found_error"
        assert "claude-nope" in found.value.body["error"]["message"]
        r = await c.post("/v1/chat/completions", json=chat("echo", keep_alive="soon"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
        assert registry.table["echo"].inflight == registry.table["tiny-a"].inflight == 0
        await client.close()
        await sdk.close()


async def test_one_model_is_kept_and_answers_any_name(models_dir: Path) -> None:
    """``afm serve --model M`` (no --keep-alive): loaded first, kept, any ``model`` accepted."""
    async with running_models(m(models_dir, "echo"), pinned=True, preload=["echo"], warmup=False) \
            as (url, registry), httpx.AsyncClient(base_url=url, timeout=WAIT) as c:
        assert await states(c) == {"echo": "loaded"}
        r = await c.post("/v1/chat/completions", json=chat("gpt-4o", "any name", keep_alive=0))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "any name"
        assert r.json()["model"] == "gpt-4o"  # echoed, as before
        row = registry.table["echo"]
        assert row.state == "loaded" and row.expires is None  # keep_alive 0 ignored: kept
        assert "models" not in (await c.get("/health")).json()


async def test_keep_alive_unloads_idle_models_and_they_load_again(models_dir: Path) -> None:
    async with running_models(m(models_dir, "echo", "tiny-a"), keep_alive=0.3, warmup=False) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=WAIT) as c:
        assert (await c.post("/v1/chat/completions", json=chat("echo", "one"))).status_code == 200
        await until_state(c, "echo", "unloaded")  # loaded -> unloaded after its keep-alive
        assert await metric(c, "afm_model_unloads_total", "echo", ',reason="idle"') == 1
        r = await c.post("/v1/chat/completions", json=chat("echo", "two"))
        assert r.json()["choices"][0]["message"]["content"] == "two"  # loads again
        assert await metric(c, "afm_model_loads_total", "echo") == 2
        assert (await c.get("/health")).json()["status"] == "ok"


async def test_a_request_keep_alive_as_ollama(models_dir: Path) -> None:
    async with running_models(m(models_dir, "echo", "tiny-a"), warmup=False) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=WAIT) as c:  # the default keeps models
        assert (await c.post("/v1/chat/completions", json=chat("tiny-a", keep_alive=-1))).status_code == 200
        assert (await c.post("/v1/chat/completions", json=chat("echo", keep_alive=0))).status_code == 200
        await until_state(c, "echo", "unloaded")  # 0: unloaded right after the request
        assert (await states(c))["tiny-a"] == "loaded"
        r = await c.post("/v1/messages", json={"model": "echo", "max_tokens": 8, "keep_alive": "0s",
                                               "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
        await until_state(c, "echo", "unloaded")
        assert await metric(c, "afm_model_unloads_total", "echo", ',reason="idle"') == 2
        assert await metric(c, "afm_model_unloads_total", "tiny-a", ',reason="idle"') == 0


async def test_budget_evicts_the_least_recently_used_idle_model(models_dir: Path) -> None:
    size = weights_bytes(models_dir / "tiny-a")
    assert size == weights_bytes(models_dir / "tiny-c") > 100_000
    async with running_models(m(models_dir, "tiny-a", "tiny-b", "tiny-c"), max_loaded_bytes=2 * size + 1000,
                              warmup=False) as (url, _), httpx.AsyncClient(base_url=url, timeout=WAIT) as c:
        for model in ("tiny-a", "tiny-b", "tiny-a"):  # b is now the least recently used
            assert (await c.post("/v1/chat/completions", json=chat(model))).status_code == 200
        assert (await c.post("/v1/chat/completions", json=chat("tiny-c"))).status_code == 200
        assert await states(c) == {"tiny-a": "loaded", "tiny-b": "unloaded", "tiny-c": "loaded"}
        assert await metric(c, "afm_model_unloads_total", "tiny-b", ',reason="evicted"') == 1
        assert await metric(c, "afm_model_unloads_total", "tiny-a", ',reason="evicted"') == 0


async def test_budget_never_evicts_a_model_with_an_open_stream(models_dir: Path) -> None:
    """B waits for room while A streams; A's cancel frees it; then A is evicted and B answers."""
    size = weights_bytes(models_dir / "tiny-a")
    async with running_models(m(models_dir, "tiny-a", "tiny-b"), max_loaded_bytes=size + 1000,
                              warmup=False) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=WAIT) as c, trio.open_nursery() as nursery:
        order: list[str] = []
        b_done = trio.Event()

        async def ask_b() -> None:
            r = await c.post("/v1/chat/completions", json=chat("tiny-b"))
            assert r.status_code == 200 and r.json()["model"] == "tiny-b"
            order.append("b answered")
            b_done.set()

        body = {"model": "tiny-a", "prompt": "go", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body, headers={"X-Request-ID": "long-a"}) as r:
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break  # A streams
            nursery.start_soon(ask_b)

            async def b_waits() -> bool:
                return await metric(c, "afm_model_requests_inflight", "tiny-b") == 1

            await until(b_waits, "B's request waiting")
            seen = 0
            async for line in lines:  # A goes on while B waits for room
                if line.startswith("data: "):
                    seen += 1
                    if seen == 20:
                        break
            assert await states(c) == {"tiny-a": "loaded", "tiny-b": "unloaded"}
            assert not b_done.is_set()
            cancel = await c.post("/v1/chat/completions/long-a/cancel")
            assert cancel.status_code == 200
            finish = None
            async for line in lines:
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0].get("finish_reason") or finish
            assert finish == "cancelled"
            order.append("a ended")
        with trio.fail_after(WAIT):
            await b_done.wait()
        assert order == ["a ended", "b answered"]
        assert await states(c) == {"tiny-a": "unloaded", "tiny-b": "loaded"}
        assert await metric(c, "afm_model_unloads_total", "tiny-a", ',reason="evicted"') == 1


async def test_a_stream_flows_while_another_model_loads_and_first_requests_share_a_load(
        models_dir: Path) -> None:
    gate, started, opened = trio.Event(), {"echo": trio.Event()}, {}
    opener = gated_opener({"echo": gate}, opened, started)
    async with running_models(m(models_dir, "tiny-a", "echo"), preload=["tiny-a"], opener=opener) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=WAIT) as c, trio.open_nursery() as nursery:
        answers: list[str] = []
        all_answered = trio.Event()

        async def ask_echo(i: int) -> None:
            r = await c.post("/v1/chat/completions", json=chat("echo", f"echo {i}"))
            answers.append(r.json()["choices"][0]["message"]["content"])
            if len(answers) == 3:
                all_answered.set()

        body = {"model": "tiny-a", "prompt": "go", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body, headers={"X-Request-ID": "flow-a"}) as r:
            lines = r.aiter_lines()

            async def next_chunk() -> None:
                async for line in lines:
                    if line.startswith("data: "):
                        return
                raise AssertionError("A's stream ended")

            await next_chunk()
            for i in range(3):  # three first requests at once
                nursery.start_soon(ask_echo, i)
            with trio.fail_after(WAIT):
                await started["echo"].wait()
            assert (await states(c))["echo"] == "loading"
            for _ in range(10):  # A's tokens keep coming while echo loads (its load is held)
                await next_chunk()
            assert (await states(c))["echo"] == "loading" and not answers
            gate.set()  # now the real load: on its own generation thread, with its warm-up
            during_load = 0
            while not all_answered.is_set():
                await next_chunk()
                if not answers:
                    during_load += 1
            assert during_load >= 1  # A produced while echo's weights loaded and warmed up
            await c.post("/v1/chat/completions/flow-a/cancel")
        assert sorted(answers) == ["echo 0", "echo 1", "echo 2"]
        assert opened == {"tiny-a": 1, "echo": 1}  # one load shared by the three
        assert await metric(c, "afm_model_loads_total", "echo") == 1


async def test_a_request_for_an_unloading_model_waits_and_loads_it_again(models_dir: Path) -> None:
    closing, opened = {"echo": trio.Event()}, {}
    async with running_models(m(models_dir, "echo", "tiny-a"), warmup=False,
                              opener=gated_opener({}, opened, closing=closing)) as (url, _), \
            httpx.AsyncClient(base_url=url, timeout=WAIT) as c:
        assert (await c.post("/v1/chat/completions", json=chat("echo", "first", keep_alive=0))).status_code == 200
        await until_state(c, "echo", "unloading")  # held there by the gate
        async with trio.open_nursery() as nursery:
            got: list[httpx.Response] = []

            async def ask() -> None:
                got.append(await c.post("/v1/chat/completions", json=chat("echo", "second")))

            nursery.start_soon(ask)

            async def waiting() -> bool:
                return await metric(c, "afm_model_requests_inflight", "echo") == 1

            await until(waiting, "the request waiting")
            assert (await states(c))["echo"] == "unloading"
            closing["echo"].set()
        assert got[0].status_code == 200 and got[0].json()["choices"][0]["message"]["content"] == "second"
        assert opened["echo"] == 2 and (await states(c))["echo"] == "loaded"


async def test_a_model_that_cannot_load_fails_its_requests_only(models_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    specs = [ModelSpec("echo", str(models_dir / "echo")), ModelSpec("broken", str(broken))]
    async with running_models(specs, warmup=False) as (url, _), httpx.AsyncClient(base_url=url, timeout=WAIT) as c:
        r = await c.post("/v1/chat/completions", json=chat("broken"))
        assert r.status_code == 500 and r.json()["error"]["code"] == "model_load_failed"
        assert (await states(c))["broken"] == "unloaded"
        assert await metric(c, "afm_model_load_failures_total", "broken") == 1
        r = await c.post("/v1/chat/completions", json=chat("echo", "still here"))
        assert r.json()["choices"][0]["message"]["content"] == "still here"
        assert (await c.get("/health")).json()["status"] == "ok"


def test_afm_serve_models_dir_keep_alive_and_budget(models_dir: Path) -> None:
    """The command line: --models-dir, --model beside it, --keep-alive, --max-loaded-bytes."""
    extra = make_echo_model(models_dir.parent / "extra-echo")
    server = LoggedProcess([sys.executable, "-m", "afm_core._cli", "serve", "--quiet", "--port", "0",
                            "--no-warmup", "--model", str(extra), "--models-dir", str(models_dir),
                            "--keep-alive", "300ms", "--max-loaded-bytes", "1M"])
    try:
        found = server.wait_for(r"serving 5 models on (http://127\.0\.0\.1:\d+)")
        assert found, server.log()
        url = found.group(1)
        with httpx.Client(base_url=url, timeout=WAIT) as c:
            assert [d["id"] for d in c.get("/v1/models").json()["data"]] == [
                "extra-echo", "echo", "tiny-a", "tiny-b", "tiny-c"]
            r = c.post("/v1/chat/completions", json=chat("tiny-b"))
            assert r.status_code == 200 and r.json()["model"] == "tiny-b"
            r = c.post("/v1/chat/completions", json=chat(None, "to the first"))
            assert r.json()["choices"][0]["message"]["content"] == "to the first"
            assert c.post("/v1/chat/completions", json=chat("tiny")).status_code == 404
        assert server.wait_for(r"model tiny-b unloaded", timeout=WAIT), server.log()
        assert "afm_models_max_loaded_bytes 1048576" in httpx.get(url + "/metrics").text
    finally:
        server.kill()


def test_afm_serve_refuses_several_models_with_distributed(echo_model_dir: Path) -> None:
    server = LoggedProcess([sys.executable, "-m", "afm_core._cli", "serve", "--model", str(echo_model_dir),
                            "--model", str(echo_model_dir), "--distributed", "tensor"])
    try:
        assert server.proc.wait(timeout=WAIT) == 1
        assert "--distributed serves one model" in server.log()
    finally:
        server.kill()
