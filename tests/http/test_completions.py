"""``POST /v1/completions`` end to end: a real hypercorn server on 127.0.0.1,
driven by the openai SDK (``client.completions.create``), a vLLM-bench-style
raw payload, lm-evaluation-harness's loglikelihood payload, bad input and
cancellation."""

from __future__ import annotations

import json
from operator import itemgetter
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import openai
import pytest
import trio

from afm_http.testing import running_server

COMPLETIONS = "/v1/completions"
CHAT_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def sse(client: httpx.AsyncClient, payload: dict, headers: dict | None = None) -> tuple[httpx.Response, list, list]:
    """(response, parsed chunks, raw data strings), checking the SSE framing."""
    chunks, raw = [], []
    async with client.stream("POST", COMPLETIONS, json=payload, headers=headers or {}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                raw.append(line[6:])
                if line[6:] != "[DONE]":
                    chunks.append(json.loads(line[6:]))
            else:
                assert line == "", line
    return r, chunks, raw


@pytest.fixture(scope="module")
def random_mlx(random_model_dir: Path) -> tuple[Any, Any]:
    import mlx_lm

    return mlx_lm.load(str(random_model_dir))  # type: ignore[return-value]


def forward_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log P(ids[i + 1] | ids[: i + 1]) from one forward pass over ``ids``."""
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


# -- the openai SDK --------------------------------------------------------------------


async def test_sdk_create_streamed_and_not(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        client = sdk(url)
        prompt = CHAT_PROMPT.format("hello completions")
        resp = await client.completions.create(model="m", prompt=prompt, max_tokens=40)
        assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == "m"
        (choice,) = resp.choices
        assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == \
            (0, "hello completions", "stop", None)
        assert resp.usage is not None and resp.usage.completion_tokens > 0
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
        # the default max_tokens is OpenAI's 16
        long = await client.completions.create(model="m", prompt=CHAT_PROMPT.format("word " * 40))
        assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 16

        stream = await client.completions.create(model="m", prompt=prompt, max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True})
        parts, finishes, usage, ids = [], [], None, set()
        async for chunk in stream:
            ids.add(chunk.id)
            assert chunk.object == "text_completion"
            for c in chunk.choices:
                parts.append(c.text)
                finishes.append(c.finish_reason)
            if chunk.usage:
                assert chunk.choices == []
                usage = chunk.usage
        assert "".join(parts) == "hello completions" and len(ids) == 1
        assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
        assert usage is not None and usage.completion_tokens == resp.usage.completion_tokens
        assert engine.statistics().requests_active == 0
        await client.close()


async def test_sdk_list_of_prompts_and_token_ids(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, _):
        client = sdk(url)
        texts = ["first", "second prompt", "third, the longest of them"]
        resp = await client.completions.create(
            model="m", prompt=[CHAT_PROMPT.format(t) for t in texts], max_tokens=40, echo=True)
        assert [c.index for c in resp.choices] == [0, 1, 2]
        assert [c.text for c in resp.choices] == [CHAT_PROMPT.format(t) + t for t in texts]
        async with httpx.AsyncClient(base_url=url) as c:
            ids = (await c.post("/tokenize", json={"content": CHAT_PROMPT.format("from ids")})).json()["tokens"]
        one = await client.completions.create(model="m", prompt=ids, max_tokens=40)
        assert one.choices[0].text == "from ids" and one.usage.prompt_tokens == len(ids)
        two = await client.completions.create(model="m", prompt=[ids, ids], max_tokens=40,
                                              echo=True)
        assert [c.text for c in two.choices] == [CHAT_PROMPT.format("from ids") + "from ids"] * 2
        assert two.usage.prompt_tokens == 2 * len(ids)
        # n > 1: prompt-major choice numbers
        many = await client.completions.create(model="m", prompt=[CHAT_PROMPT.format("a"), CHAT_PROMPT.format("b")],
                                               n=2, max_tokens=5)
        assert [(c.index, c.text) for c in many.choices] == [(0, "a"), (1, "a"), (2, "b"), (3, "b")]
        # streamed: each choice's text and finish, then one usage chunk for all
        stream = await client.completions.create(model="m", prompt=[CHAT_PROMPT.format(t) for t in texts],
                                                 max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True})
        got: dict[int, str] = {}
        finished: dict[int, str] = {}
        usages = []
        async for chunk in stream:
            for c in chunk.choices:
                got[c.index] = got.get(c.index, "") + c.text
                if c.finish_reason:
                    finished[c.index] = c.finish_reason
            if chunk.usage:
                usages.append(chunk.usage)
        assert got == dict(enumerate(texts)) and finished == dict.fromkeys(range(3), "stop")
        assert len(usages) == 1 and usages[0].completion_tokens == resp.usage.completion_tokens
        await client.close()


async def test_sdk_logprobs_and_echo_score_the_prompt(random_model_dir: Path,
                                                      random_mlx: tuple[Any, Any]) -> None:
    model, tok = random_mlx
    # (kv_dtype "model": the reference is a float32 forward pass; a float16 cache rounds keys and values)
    async with running_server(random_model_dir, kv_dtype="model") as (url, _):
        client = sdk(url)
        prompt = "The capital of France is"
        ids = tok.encode(prompt)
        resp = await client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0,
                                               echo=True, logprobs=2)
        (c,) = resp.choices
        lp = c.logprobs
        assert lp is not None and c.text.startswith(prompt)
        n = len(ids)
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
        assert lp.tokens[:n] == [tok.decode([i]) for i in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = forward_logprobs(model, ids)
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:n], want, strict=True)) < 1e-4
        assert all(len(t) <= 2 and max(t.values()) >= v - 1e-6
                   for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True))
        # text offsets: running lengths of the token texts, the generated ones after the echo
        assert lp.text_offset[:n] == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
        assert lp.text_offset[n] == len(prompt)
        assert c.text == prompt + "".join(lp.tokens[n:])
        # streamed: the same logprobs, the echo first
        stream = await client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0,
                                                 echo=True, logprobs=2, stream=True)
        chunks = [ch async for ch in stream]
        assert chunks[0].choices[0].text == prompt
        streamed = [t for ch in chunks for cc in ch.choices if cc.logprobs for t in cc.logprobs.token_logprobs]
        assert streamed == lp.token_logprobs
        # logprobs without echo: the generated tokens only
        plain = await client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=0,
                                                logprobs=0)
        assert plain.choices[0].logprobs.token_logprobs == lp.token_logprobs[n:]
        assert plain.choices[0].logprobs.text_offset[0] == 0
        await client.close()


# -- other clients -------------------------------------------------------------------


async def test_vllm_bench_style_payload_with_ignore_eos(echo_model_dir: Path) -> None:
    payload = {"model": "bench", "prompt": CHAT_PROMPT.format("short"), "max_tokens": 64, "temperature": 0.0,
               "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "best_of": 1, "logprobs": None,
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    async with running_server(echo_model_dir) as (url, _), httpx.AsyncClient(base_url=url) as c:
        r, chunks, raw = await sse(c, payload)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert raw[-1] == "[DONE]"
        # what vllm bench reads: text from chunks with choices, output tokens from the usage chunk
        text, output_tokens = "", None
        for data in chunks:
            if choices := data.get("choices"):
                text += choices[0].get("text") or ""
            elif usage := data.get("usage"):
                output_tokens = usage.get("completion_tokens")
        assert text == "short" and output_tokens == 64  # generated through the EOS to max_tokens
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        # without ignore_eos it stops at the EOS
        _, chunks, _ = await sse(c, {**payload, "ignore_eos": False})
        assert chunks[-1]["usage"]["completion_tokens"] < 64


def lm_eval_parse(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's LocalCompletionsAPI.parse_logprobs (its max_tokens 1 payload)."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens, strict=True):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs, strict=True))
        res.append((logprobs, is_greedy))
    return res


async def test_lm_eval_loglikelihood_payload(random_model_dir: Path, random_mlx: tuple[Any, Any]) -> None:
    model, tok = random_mlx
    context = tok.encode("Question: what is the capital of France? Answer:")
    continuations = [tok.encode(" Paris"), tok.encode(" a city by the Seine")]
    prompts = [context + cont for cont in continuations]
    payload = {"model": "m", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    async with running_server(random_model_dir, kv_dtype="model") as (url, _), httpx.AsyncClient(base_url=url) as c:
        r = await c.post(COMPLETIONS, json=payload)
        assert r.status_code == 200, r.text
        out = r.json()
        got = lm_eval_parse(out, [len(context)] * 2)
        for (loglik, greedy), prompt in zip(got, prompts, strict=True):
            want = forward_logprobs(model, prompt)[len(context) - 1:]
            assert abs(loglik - sum(want)) < 1e-3
            # greedy iff every continuation token is the model's argmax after what precedes it
            logits = model(mx.array(prompt)[None])[0]
            argmax = mx.argmax(logits, axis=-1).tolist()
            assert greedy == all(argmax[i - 1] == prompt[i] for i in range(len(context), len(prompt)))
        # max_tokens 0: the prompt alone, first token null, nothing generated
        r = await c.post(COMPLETIONS, json={**payload, "max_tokens": 0})
        assert r.status_code == 200, r.text
        for choice, prompt in zip(r.json()["choices"], prompts, strict=True):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(prompt) and lp["token_logprobs"][0] is None
            want = forward_logprobs(model, prompt)
            assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want, strict=True)) < 1e-4
            assert choice["finish_reason"] == "length" and choice["text"] == tok.decode(prompt)
        assert r.json()["usage"]["completion_tokens"] == 0


# -- bad input ----------------------------------------------------------------------------


def assert_envelope(r: httpx.Response, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


async def test_bad_input_is_a_400_envelope(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir, max_batch=2, max_waiting=2) as (url, engine), \
            httpx.AsyncClient(base_url=url) as c:
        err = assert_envelope(await c.post(COMPLETIONS, json={"prompt": "def f(", "suffix": "    return 1"}),
                              "suffix", "unsupported")
        assert "fill-in-the-middle" in err["message"]
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": ""}), "prompt")
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": []}), "prompt")
        assert_envelope(await c.post(COMPLETIONS, json={}), "prompt")
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": [[1, 2], "x", 3]}), "prompt[2]")
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": "10"}), "max_tokens")
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": "x", "logprobs": True}), "logprobs")
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": "x", "echo": "yes"}), "echo")
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": [5, 10**6]}), "prompt[1]")
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": [5, 10**6], "echo": True}), "prompt[1]")
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 10**6}), "max_tokens",
                        "context_length_exceeded")
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": "x", "best_of": 2}), "best_of")
        # more choices than the engine takes at once (max_batch + max_waiting)
        assert_envelope(await c.post(COMPLETIONS, json={"prompt": ["a"] * 5}), "prompt")
        assert_envelope(await c.post(COMPLETIONS, content=b"[1, 2]",
                                     headers={"Content-Type": "application/json"}), "body")
        # a model that cannot score its prompt says so, before streaming and while streaming
        err = assert_envelope(await c.post(COMPLETIONS, json={"prompt": "two words", "echo": True, "logprobs": 1}),
                              code="unsupported")
        _, chunks, raw = await sse(c, {"prompt": "two words", "echo": True, "logprobs": 1, "stream": True})
        assert chunks[-1]["error"]["code"] == "unsupported" and raw[-1] == "[DONE]"
        assert engine.statistics().requests_active == 0
        r = await c.post(COMPLETIONS, json={"prompt": CHAT_PROMPT.format("still ok")})
        assert r.json()["choices"][0]["text"] == "still ok"


async def test_a_failing_choice_stops_the_others(echo_model_dir: Path) -> None:
    # a one-token prompt has nothing to score; the echo model cannot score a longer one
    payload = {"prompt": [[5], CHAT_PROMPT.format("x")], "echo": True, "logprobs": 0, "max_tokens": 5000,
               "ignore_eos": True}
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        assert_envelope(await c.post(COMPLETIONS, json=payload), code="unsupported")
        _, chunks, raw = await sse(c, {**payload, "stream": True})
        assert "error" in chunks[-1] and raw[-1] == "[DONE]"
        assert not any(ch["choices"] and ch["choices"][0]["finish_reason"] for ch in chunks)
        with trio.fail_after(10):
            while engine.statistics().running or engine.statistics().requests_active:
                await trio.sleep(0.01)
        assert engine.statistics().generation_tokens < 2 * 5000


# -- cancellation -------------------------------------------------------------------------


async def test_cancel_by_request_id_ends_every_choice(echo_model_dir: Path) -> None:
    long = CHAT_PROMPT.format("word " * 3000)
    async with running_server(echo_model_dir) as (url, engine), httpx.AsyncClient(base_url=url) as c:
        chunks: list = []
        raw: list = []

        async def consume() -> None:
            async with c.stream("POST", COMPLETIONS, json={"prompt": [long, long], "max_tokens": 5000,
                                                          "stream": True},
                                headers={"X-Request-ID": "cmpl-cancel-me"}) as r:
                assert r.headers["x-request-id"] == "cmpl-cancel-me"
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        raw.append(line[6:])
                        if line[6:] != "[DONE]":
                            chunks.append(json.loads(line[6:]))

        async with trio.open_nursery() as n:
            n.start_soon(consume)
            with trio.fail_after(20):
                while {ch["choices"][0]["index"] for ch in chunks if ch["choices"]} != {0, 1} or len(chunks) < 10:
                    await trio.sleep(0.01)
            r = await c.post("/v1/chat/completions/cmpl-cancel-me/cancel")
            assert r.status_code == 200 and r.json()["cancelled"] is True
        finishes = {ch["choices"][0]["index"]: ch["choices"][0]["finish_reason"]
                    for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]}
        assert finishes == {0: "cancelled", 1: "cancelled"} and raw[-1] == "[DONE]"
        assert (await c.post("/v1/chat/completions/cmpl-cancel-me/cancel")).status_code == 404
        stats = engine.statistics()
        assert stats.running == 0 and stats.requests_active == 0
        assert stats.generation_tokens < 2 * 3000


async def test_client_disconnect_stops_every_choice(echo_model_dir: Path) -> None:
    long = CHAT_PROMPT.format("word " * 3000)
    async with running_server(echo_model_dir) as (url, engine):
        async with httpx.AsyncClient(base_url=url) as c:
            async with c.stream("POST", COMPLETIONS, json={"prompt": [long, long], "max_tokens": 5000,
                                                          "stream": True}) as r:
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if n > 10:
                        break
        with trio.fail_after(10):
            while engine.statistics().running or engine.statistics().requests_active:
                await trio.sleep(0.01)
        abandoned = engine.statistics()
        assert abandoned.generation_tokens < 2 * 3000
        # while a probe runs to its end, its tokens are all the engine generates
        async with httpx.AsyncClient(base_url=url) as c:
            probe = (await c.post(COMPLETIONS, json={"prompt": CHAT_PROMPT.format("probe " * 20),
                                                     "max_tokens": 100})).json()
        after = engine.statistics()
        assert probe["choices"][0]["finish_reason"] == "stop"
        assert after.generation_tokens - abandoned.generation_tokens == probe["usage"]["completion_tokens"] > 0
        assert after.running == after.requests_active == 0


async def test_non_streaming_disconnect_stops_generation(echo_model_dir: Path) -> None:
    async with running_server(echo_model_dir) as (url, engine):
        async with httpx.AsyncClient(base_url=url) as c, trio.open_nursery() as n:

            async def post() -> None:
                await c.post(COMPLETIONS, json={"prompt": CHAT_PROMPT.format("word " * 3000),
                                                "max_tokens": 5000})

            n.start_soon(post)
            with trio.fail_after(20):
                while engine.statistics().generation_tokens < 10:
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()  # the client goes away mid-request
        with trio.fail_after(10):
            while engine.statistics().running or engine.statistics().requests_active:
                await trio.sleep(0.01)
        assert engine.statistics().generation_tokens < 3000
