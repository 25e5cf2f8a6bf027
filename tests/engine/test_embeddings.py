"""Engine.embed: vectors from the generation thread, its refusals, cancellation, and streams undisturbed."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.lowlevel

from afm_core import (
    ContentDelta,
    ContextLengthError,
    EngineConfig,
    RequestError,
    UnsupportedError,
    open_engine,
)
from afm_core._mlx.embeddings import embed


@pytest.fixture(scope="module")
def expected(random_model_dir: Path) -> tuple[list[list[int]], dict[str, list[list[float]]]]:
    """Token lists and their vectors computed directly (unfused model, this thread, no engine)."""
    import mlx_lm

    model, tok = mlx_lm.load(str(random_model_dir))
    ids = [list(tok.encode("The quick brown fox")), list(tok.encode("jumps")), [7, 8, 9, 10]]
    return ids, {p: embed(model, ids, p) for p in ("mean", "last", "cls")}


async def test_vectors_equal_the_direct_computation(random_model_dir: Path, expected: Any) -> None:
    ids, want = expected
    async with open_engine(random_model_dir) as engine:  # CPU fusion on: equal up to rounding
        got = await engine.embed(["The quick brown fox", "jumps", [7, 8, 9, 10]])
        assert got.pooling == "mean" and got.token_counts == tuple(len(t) for t in ids)
        assert got.prompt_tokens == sum(len(t) for t in ids)
        np.testing.assert_allclose(got.vectors, want["mean"], atol=1e-4)
        for pooling in ("last", "cls"):
            got = await engine.embed(["The quick brown fox", "jumps", [7, 8, 9, 10]], pooling=pooling)
            np.testing.assert_allclose(got.vectors, want[pooling], atol=1e-4)
        # one text, one token-id list: the same vectors as inside a list
        np.testing.assert_allclose((await engine.embed("jumps")).vectors, [want["mean"][1]], atol=1e-4)
        np.testing.assert_allclose((await engine.embed([7, 8, 9, 10])).vectors, [want["mean"][2]], atol=1e-4)
    # inputs sent in parts of about prefill_step tokens: the same vectors, in order
    async with open_engine(random_model_dir, embedding_pooling="last", prefill_step=4,
                           warmup=False) as engine:
        got = await engine.embed(ids)
        assert got.pooling == "last"
        np.testing.assert_allclose(got.vectors, want["last"], atol=1e-4)


async def test_refusals(random_model_dir: Path, echo_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="embedding_pooling"):
        EngineConfig(embedding_pooling="max")
    async with open_engine(random_model_dir, warmup=False) as engine:
        for bad in ("", [], [[]], ["ok", 3], [[1, -1]], [[1, 10**9]], b"bytes"):
            with pytest.raises(RequestError):
                await engine.embed(bad)  # type: ignore[arg-type]
        with pytest.raises(RequestError, match="pooling"):
            await engine.embed("x", pooling="max")
        with pytest.raises(ContextLengthError):
            await engine.embed([[5] * (engine.context_length + 1)])
        assert len((await engine.embed("still serving")).vectors) == 1
    async with open_engine(echo_model_dir, warmup=False) as engine:
        with pytest.raises(UnsupportedError, match="cannot compute embeddings"):
            await engine.embed("echo has no body")


async def test_cancelled_callers_leave_the_engine_working(random_model_dir: Path, expected: Any) -> None:
    ids, want = expected
    rng = random.Random(5)
    async with open_engine(random_model_dir, warmup=False) as engine:

        async def cancelled_soon(delay: float) -> None:
            with trio.move_on_after(delay):
                await engine.embed([[rng.randrange(3, 1000) for _ in range(200)]] * 8)

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(cancelled_soon, i * 0.002)
        got = await engine.embed(ids)
        np.testing.assert_allclose(got.vectors, want["mean"], atol=1e-4)


async def test_embedding_during_a_stream_leaves_its_output_unchanged(random_model_dir: Path) -> None:
    request = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 40,
               "temperature": 0}
    async with open_engine(random_model_dir, prefix_cache_bytes=0, warmup=False) as engine:
        alone = (await engine.complete(request))["choices"][0]["message"]["content"]
        vectors: list[Any] = []
        async with engine.stream(request) as stream, trio.open_nursery() as nursery:
            parts: list[str] = []
            first = True
            async for batch in stream.batches():
                if first:  # the stream is decoding: embed between its steps
                    first = False
                    for n in range(3):
                        nursery.start_soon(lambda n=n: _embed_into(engine, n, vectors))
                parts.extend(e.text for e in batch if isinstance(e, ContentDelta))
        assert alone and "".join(parts) == alone
        assert len(vectors) == 3


async def _embed_into(engine: Any, n: int, out: list[Any]) -> None:
    out.append((await engine.embed([f"text number {n}"] * 4)).vectors)


async def test_embedding_calls_count_in_statistics_and_admission(random_model_dir: Path) -> None:
    from afm_core import ChatRequest, EngineBusyError

    async with open_engine(random_model_dir, max_batch=1, max_waiting=0, warmup=False) as engine:
        got = await engine.embed(["The quick brown fox", [7, 8, 9]])
        stats = engine.statistics()
        assert stats.embedding_requests == 1 and stats.embedding_tokens == got.prompt_tokens
        assert stats.embeddings_active == 0
        # the one place is taken by a stream: an embedding call is refused like a second stream
        req = ChatRequest(messages=({"role": "user", "content": "hi"},), max_tokens=200)
        async with engine.stream(req):
            with pytest.raises(EngineBusyError):
                await engine.embed("jumps")
        assert engine.statistics().embedding_requests == 1

        # and an embedding call in progress holds the place against a stream
        started = trio.Event()
        async with trio.open_nursery() as nursery:

            async def embed_many() -> None:
                started.set()
                await engine.embed(["a long text " * 100] * 4)

            nursery.start_soon(embed_many)
            await started.wait()
            await trio.lowlevel.checkpoint()
            assert engine.statistics().embeddings_active == 1
            with pytest.raises(EngineBusyError):
                async with engine.stream(req):
                    pass
        stats = engine.statistics()
        assert stats.embedding_requests == 2 and stats.embeddings_active == 0
