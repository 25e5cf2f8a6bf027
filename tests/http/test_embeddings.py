"""POST /v1/embeddings end to end: a real hypercorn on 127.0.0.1 and the openai SDK."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import trio

from afm_http.testing import running_server


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_openai_sdk_embeddings(random_model_dir: Path) -> None:
    async with running_server(random_model_dir, warmup=False) as (url, engine):
        c = client(url)
        one = await c.embeddings.create(model="m", input="The quick brown fox", encoding_format="float")
        assert one.object == "list" and one.model == "m" and len(one.data) == 1
        vec = one.data[0].embedding
        assert one.data[0].index == 0 and len(vec) == 64
        assert np.linalg.norm(vec) == pytest.approx(1.0, abs=1e-5)
        ids = await engine.tokenize("The quick brown fox", add_special_tokens=True)
        assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)

        many = await c.embeddings.create(model="m", input=["jumps", "The quick brown fox"],
                                         encoding_format="float")
        assert [d.index for d in many.data] == [0, 1]
        np.testing.assert_allclose(many.data[1].embedding, vec, atol=1e-5)  # the same text in a batch

        by_ids = await c.embeddings.create(model="m", input=ids, encoding_format="float")
        np.testing.assert_allclose(by_ids.data[0].embedding, vec, atol=1e-6)
        lists = await c.embeddings.create(model="m", input=[ids, [5, 6, 7]], encoding_format="float")
        np.testing.assert_allclose(lists.data[0].embedding, vec, atol=1e-5)
        assert lists.usage.prompt_tokens == len(ids) + 3

        # the SDK's default asks for base64 and decodes it
        b64 = await c.embeddings.create(model="m", input="The quick brown fox")
        np.testing.assert_allclose(b64.data[0].embedding, vec, atol=1e-6)

        short = await c.embeddings.create(model="m", input="The quick brown fox", dimensions=16,
                                          encoding_format="float")
        assert len(short.data[0].embedding) == 16
        assert np.linalg.norm(short.data[0].embedding) == pytest.approx(1.0, abs=1e-5)
        await c.close()


async def test_bad_input_is_a_400(random_model_dir: Path, echo_model_dir: Path) -> None:
    async with running_server(random_model_dir, warmup=False) as (url, engine):
        c = client(url)
        for kwargs in ({"input": ""}, {"input": []}, {"input": [[]]}, {"input": [1.5]},
                       {"input": [[5] * (engine.context_length + 1)]}, {"input": [10**9]},
                       {"input": "x", "dimensions": 65}, {"input": "x", "encoding_format": "int8"}):
            with pytest.raises(openai.BadRequestError) as info:
                await c.embeddings.create(model="m", **kwargs)  # type: ignore[arg-type]
            assert info.value.status_code == 400
            assert isinstance(info.value.body, dict) and info.value.body.get("message")
        with pytest.raises(openai.BadRequestError, match=r"hidden size \(64\)"):
            await c.embeddings.create(model="m", input="x", dimensions=65)
        await c.close()
        async with httpx.AsyncClient(base_url=url) as h:
            for raw in (b"[1, 2]", b"not json", b'{"input": {"a": 1}}'):
                r = await h.post("/v1/embeddings", content=raw,
                                 headers={"content-type": "application/json"})
                assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    async with running_server(echo_model_dir, warmup=False) as (url, _):
        c = client(url)
        with pytest.raises(openai.BadRequestError, match="cannot compute embeddings"):
            await c.embeddings.create(model="m", input="echo")
        await c.close()


async def test_embeddings_do_not_disturb_a_running_stream(random_model_dir: Path) -> None:
    # a raw completion that cannot stop early (ignore_eos): 300 decode steps, so
    # the embedding calls below land between its steps, not after it
    payload = {"model": "m", "prompt": "Tell me a story", "stream": True, "max_tokens": 300,
               "temperature": 0, "ignore_eos": True}

    async def streamed_text(h: httpx.AsyncClient) -> str:
        parts = []
        async with h.stream("POST", "/v1/completions", json=payload) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    parts.extend(c["text"] for c in chunk["choices"])
        return "".join(parts)

    async with running_server(random_model_dir, prefix_cache_bytes=0, warmup=False) as (url, engine), \
            httpx.AsyncClient(base_url=url, timeout=60) as h:
        alone = await streamed_text(h)
        assert alone
        c = client(url)
        during: list[bool] = []  # per embedding call: did it end while the stream was decoding?
        streamed = trio.Event()

        async def embeds() -> None:
            # wait until the stream is decoding (or over: never hang), then embed between its steps
            while engine.statistics().running == 0 and not streamed.is_set():
                await trio.sleep(0.001)
            for n in range(3):
                r = await c.embeddings.create(model="m", input=[f"text {n}"] * 4, encoding_format="float")
                assert len(r.data) == 4
                during.append(not streamed.is_set() and engine.statistics().running == 1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(embeds)
            with_embeds = await streamed_text(h)
            streamed.set()
        assert with_embeds == alone
        assert len(during) == 3 and any(during), during  # they really ran mid-stream
        await c.close()


@pytest.fixture(scope="module")
def embedding_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second random model, of another width than the served one (32, not 64)."""
    from afm_core.testing import make_random_model

    return make_random_model(tmp_path_factory.mktemp("embedder") / "emb-32", hidden_size=32, seed=7)


async def test_a_dedicated_embedding_model_answers_embeddings(echo_model_dir: Path,
                                                              embedding_model_dir: Path) -> None:
    """``--embedding-model``: the echo model (which has no hidden states) serves chat, the
    embedding model /v1/embeddings, each on its own engine; /v1/models lists both."""
    import mlx_lm

    from afm_core import open_engine
    from afm_core._mlx.embeddings import embed

    model, tok = mlx_lm.load(str(embedding_model_dir))
    want = embed(model, [tok.encode("The quick brown fox")], "last")[0]
    async with open_engine(embedding_model_dir, embedding_pooling="last", warmup=False,
                           prefix_cache_bytes=0) as embedder, \
            running_server(echo_model_dir, embedder=embedder) as (url, engine), \
            httpx.AsyncClient(base_url=url, timeout=60) as h:
        c = client(url)
        got = await c.embeddings.create(model="any", input="The quick brown fox", encoding_format="float")
        assert len(got.data[0].embedding) == 32 and got.model == "any"
        np.testing.assert_allclose(got.data[0].embedding, want, atol=1e-4)
        assert embedder.statistics().embedding_requests == 1
        assert engine.statistics().embedding_requests == 0
        ids = [m.id for m in (await c.models.list()).data]
        assert ids == [engine.model_id, embedder.model_id]
        assert (await h.get(f"/v1/models/{embedder.model_id}")).status_code == 200
        metrics = (await h.get("/metrics")).text
        assert f'afm_embedding_requests_total{{model="{embedder.model_id}"}} 1' in metrics
        assert f'afm_embedding_requests_total{{model="{engine.model_id}"}} 0' in metrics
        assert metrics.count("# TYPE afm_embedding_requests_total counter") == 1
        assert (await h.get("/health")).json()["error"] is None
        chat = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "echo me"}])
        assert chat.choices[0].message.content == "echo me"
        await c.close()
    # without it, the echo model cannot embed: a clear 400
    async with running_server(echo_model_dir) as (url, _):
        c = client(url)
        with pytest.raises(openai.BadRequestError, match="cannot compute embeddings"):
            await c.embeddings.create(model="m", input="x")
        await c.close()


def test_afm_serve_embedding_model_flag(echo_model_dir: Path, embedding_model_dir: Path) -> None:
    from tests.http.test_server import _Server

    server = _Server("--model", str(echo_model_dir), "--port", "0", "--no-warmup",
                     "--embedding-model", str(embedding_model_dir), "--embedding-pooling", "cls")
    try:
        url = server.wait_for(r"serving .* on (http://127\.0\.0\.1:\d+)").group(1)
        server.wait_for(r"embeddings from .*emb-32 \(cls pooling\)")
        with httpx.Client(base_url=url, timeout=60) as h:
            r = h.post("/v1/embeddings", json={"input": ["a", "b"]})
            assert r.status_code == 200 and [len(d["embedding"]) for d in r.json()["data"]] == [32, 32]
            assert len(h.get("/v1/models").json()["data"]) == 2
    finally:
        server.proc.kill()
        server.proc.wait()
