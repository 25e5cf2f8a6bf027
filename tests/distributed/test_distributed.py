"""One model over two ranks on loopback: ``afm serve --distributed`` against one process.

Each group is two real processes joined by MLX's ring back-end; rank 0
serves HTTP.  The random test models are split by tensor parallelism
(qwen3) and by pipeline parallelism (qwen2); their greedy tokens, read as
each token's bytes from ``logprobs``, must be exactly those of one process
running the same requests.  A rank killed or frozen under load must end the
open stream with a ``distributed_failed`` error and turn ``/health`` 503
within the configured timeout, never hang.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from afm_core import open_engine

from .conftest import Group

CHAT = "/v1/chat/completions"
PROMPTS = ["Hello there", "Tell me a story about a cat", "1 2 3 4 5 6", "word " * 40]
SETTINGS = {"max_batch": 8, "prefill_step": 4}
FLAGS = ("--max-batch", "8", "--prefill-step", "4", "--distributed-heartbeat", "0.2",
         "--distributed-exit-after", "never")


def body(prompt: str, max_tokens: int = 16, **more: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "logprobs": True, **more}


def token_bytes(choice: dict[str, Any]) -> list[tuple[int, ...]]:
    return [tuple(t["bytes"]) for t in (choice.get("logprobs") or {}).get("content") or []]


async def reference(model: Path, waves: list[list[dict[str, Any]]],
                    embed: list[str] | None = None) -> tuple[list[list[list[tuple[int, ...]]]], Any]:
    """Each request's tokens from one process, each wave's requests sent
    together; and ``embed``'s vectors."""
    done: list[list[list[tuple[int, ...]]]] = []
    async with open_engine(model, warmup=False, **SETTINGS) as engine:
        for bodies in waves:
            out: dict[int, list[tuple[int, ...]]] = {}

            async def one(i: int, b: dict[str, Any]) -> None:
                out[i] = token_bytes((await engine.complete(b))["choices"][0])  # noqa: B023

            async with trio.open_nursery() as nursery:
                for i, b in enumerate(bodies):
                    nursery.start_soon(one, i, b)
            done.append([out[i] for i in range(len(bodies))])
        vectors = (await engine.embed(embed)).vectors if embed else None
    return done, vectors


async def stream(c: httpx.AsyncClient, payload: dict[str, Any], headers: dict[str, str] | None = None,
                 on_chunk: Any = None) -> tuple[list[dict[str, Any]], list[tuple[int, ...]]]:
    """The stream's JSON chunks (``[DONE]`` last, as None) and its tokens."""
    chunks: list[Any] = []
    tokens: list[tuple[int, ...]] = []
    async with c.stream("POST", CHAT, json={**payload, "stream": True}, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = None if line == "data: [DONE]" else json.loads(line[6:])
            chunks.append(chunk)
            if chunk and chunk.get("choices"):
                tokens += token_bytes(chunk["choices"][0])
            if on_chunk is not None:
                await on_chunk(chunk, len(chunks))
    return chunks, tokens


async def concurrently(c: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> list[list[tuple[int, ...]]]:
    out: dict[int, list[tuple[int, ...]]] = {}

    async def one(i: int, b: dict[str, Any]) -> None:
        chunks, out[i] = await stream(c, b)
        assert chunks[-1] is None and chunks[-2]["choices"][0]["finish_reason"] == "length"

    async with trio.open_nursery() as nursery:
        for i, b in enumerate(bodies):
            nursery.start_soon(one, i, b)
    return [out[i] for i in range(len(bodies))]


@pytest.fixture
def tp_group(group_factory: Any, tp_model_dir: Path) -> Group:
    group: Group = group_factory(tp_model_dir, "tensor", *FLAGS, "--distributed-timeout", "10")
    return group


async def test_tensor_parallel_matches_one_process(tp_group: Group, tp_model_dir: Path) -> None:
    bodies = [body(p, 12 + 4 * i) for i, p in enumerate(PROMPTS)]
    # sampled with a seed: rank 0's sampler decides, the follower takes its tokens
    bodies.append(body("seeded", 12, temperature=1.0, top_p=0.9, seed=3))
    long = body("tell " * 60, 8)
    texts = ["hello world", "other"]
    (want, [solo]), vectors = await reference(tp_model_dir, [bodies, [long]], texts)
    assert all(len(w) == b["max_tokens"] for w, b in zip(want, bodies, strict=True))
    assert len({w[0] for w in want}) > 1  # the model's answers differ: a real comparison
    async with httpx.AsyncClient(base_url=tp_group.url, timeout=60) as c:
        # several streams batched together on both ranks
        assert await concurrently(c, bodies) == want
        # the prefix cache (rank 0 and the follower's copy of it): the same prompt again
        again = (await c.post(CHAT, json=bodies[0])).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert token_bytes(again["choices"][0]) == want[0]

        # a shared prefill: the second request waits for the first one's prefill of the same prompt
        second: dict[str, Any] = {}

        async def when_prefilling(chunk: Any, n: int) -> None:
            progress = (chunk or {}).get("prompt_progress")
            if progress and progress["processed"] < progress["total"] and not second:
                second["started"] = True
                nursery.start_soon(post_second)

        async def post_second() -> None:
            second["reply"] = (await c.post(CHAT, json=long)).json()

        async with trio.open_nursery() as nursery:
            _, first = await stream(c, {**long, "stream_options": {"include_progress": True}},
                                    on_chunk=when_prefilling)
        reply = second["reply"]
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == reply["usage"]["prompt_tokens"] - 1
        assert first == solo and token_bytes(reply["choices"][0]) == solo

        # cancel through rank 0: the stream ends cancelled, both ranks drop the row
        async def cancel_after(chunk: Any, n: int) -> None:
            if n == 5:
                r = await c.post(f"{CHAT}/dist-cancel-1/cancel")
                assert r.status_code == 200

        chunks, _ = await stream(c, body("go on", 500), {"X-Request-ID": "dist-cancel-1"}, cancel_after)
        assert chunks[-1] is None and chunks[-2]["choices"][0]["finish_reason"] == "cancelled"
        # and the ranks are still in step
        assert await concurrently(c, bodies[:2]) == want[:2]

        # embeddings run the sharded body on every rank
        got = (await c.post("/v1/embeddings", json={"input": texts})).json()
        for item, vector in zip(got["data"], vectors, strict=True):
            assert item["embedding"] == pytest.approx(vector, abs=1e-4)
        assert (await c.get("/health")).status_code == 200
    assert tp_group.stop() == [0, 0]  # rank 0's SIGTERM stops the follower too


async def test_pipeline_parallel_matches_one_process(group_factory: Any, pp_model_dir: Path) -> None:
    bodies = [body(p, 16) for p in PROMPTS[:3]]
    [want], _ = await reference(pp_model_dir, [bodies])
    assert len({w[0] for w in want}) > 1
    group: Group = group_factory(pp_model_dir, "pipeline", *FLAGS, "--distributed-timeout", "10",
                                 "--no-warmup")
    async with httpx.AsyncClient(base_url=group.url, timeout=60) as c:
        assert await concurrently(c, bodies) == want
    # rank 0 gone: the follower sees it and exits, it does not wait forever
    leader, follower = group.ranks
    leader.kill()
    t0 = time.monotonic()
    assert await trio.to_thread.run_sync(lambda: follower.proc.wait(timeout=30)) == 1
    assert time.monotonic() - t0 < 20
    assert "lost the connection" in follower.log() or "stopped answering" in follower.log()


def test_cannot_split_the_default_models_heads_in_two() -> None:
    from afm_core import ModelLoadError
    from afm_core._models.sharded import check_tensor_parallel

    smollm = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
              "head_dim": 64, "intermediate_size": 1536,
              "quantization": {"group_size": 32, "bits": 4}}
    with pytest.raises(ModelLoadError, match="9 attention heads and 3 key-value heads do not divide by 2"):
        check_tensor_parallel(smollm, 2)
    check_tensor_parallel(smollm, 3)  # 3 heads and 1 kv head each, 192 and 512 inputs: whole groups of 32
    with pytest.raises(ModelLoadError, match="not a whole number of its quantization groups of 128"):
        check_tensor_parallel({**smollm, "quantization": {"group_size": 128}}, 3)


@pytest.mark.parametrize("how", ["killed", "frozen"])
async def test_lost_follower_ends_open_streams_with_an_error(group_factory: Any, tp_model_dir: Path,
                                                             how: str) -> None:
    group: Group = group_factory(tp_model_dir, "tensor", *FLAGS, "--distributed-timeout", "3",
                                 "--no-warmup")
    follower = group.ranks[1].proc

    async def hit(chunk: Any, n: int) -> None:
        if n == 10:
            os.kill(follower.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)

    async with httpx.AsyncClient(base_url=group.url, timeout=60) as c:
        t0 = time.monotonic()
        with trio.fail_after(30):
            chunks, _ = await stream(c, body("go on", 3000), on_chunk=hit)
        assert time.monotonic() - t0 < 20
        assert chunks[-1] is None
        error = chunks[-2]["error"]
        assert error["code"] == "distributed_failed", error
        assert "distributed group" in error["message"]
        health = await c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert "distributed group" in health.json()["error"]  # the reason, not only the status
        refused = await c.post(CHAT, json=body("hi", 4))
        assert refused.status_code == 503 and "distributed group" in refused.json()["error"]["message"]
    if how == "frozen":
        os.kill(follower.pid, signal.SIGCONT)


async def test_follower_lost_while_idle_turns_health_503(group_factory: Any, tp_model_dir: Path) -> None:
    group: Group = group_factory(tp_model_dir, "tensor", *FLAGS, "--distributed-timeout", "3",
                                 "--no-warmup")
    async with httpx.AsyncClient(base_url=group.url, timeout=60) as c:
        assert (await c.get("/health")).status_code == 200
        group.ranks[1].kill()
        with trio.fail_after(15):  # the idle heartbeat notices (0.2 s here; the timeout bounds a hang)
            while (await c.get("/health")).status_code == 200:
                await trio.sleep(0.05)
        health = (await c.get("/health")).json()
        assert health["status"] == "unavailable" and "distributed group" in health["error"]
