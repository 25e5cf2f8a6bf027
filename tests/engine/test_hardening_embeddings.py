"""Issue 31, case 8: embeddings share the generation thread with running streams.

An ``Embed`` ran whole between two decode steps: 16 inputs of 4 KB (36k
tokens) held the batch so that a running stream got 134 tokens in 14.5 s,
and one long input paused it for its whole forward pass.  Now the thread
computes at most ``embedding_step`` tokens after each decode step (a long
input in slices through a KV cache): the vectors are the ones computed
whole, and a running stream gets a token between every two slices
(``benchmarks/embedding_gap.py`` measures the gaps).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from afm_core import CompletionRequest, open_engine
from afm_core._mlx.embeddings import EmbeddingRun, NoHiddenStates, embed


@pytest.fixture(scope="module")
def model(random_model_dir: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(random_model_dir))[0]


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
@pytest.mark.parametrize("budget", [1, 5, 64, 10_000])
def test_sliced_runs_give_the_whole_computations_vectors(model: Any, pooling: str, budget: int) -> None:
    rng = random.Random(budget)
    token_lists = [[rng.randrange(20, 1000) for _ in range(n)] for n in (1, 3, 40, 7, 130, 2, 90)]
    want = embed(model, token_lists, pooling)
    run = EmbeddingRun(model, token_lists, pooling)
    steps = 0
    while not run.step(budget):
        steps += 1
        assert run.tokens_done < sum(map(len, token_lists))
    assert run.done and run.tokens_done == sum(map(len, token_lists))
    assert steps >= sum(map(len, token_lists)) // max(budget, 1) - len(token_lists) - 1
    np.testing.assert_allclose(run.result(), want, atol=2e-5)


def test_a_run_refuses_what_embed_refuses(model: Any, echo_model_dir: Path) -> None:
    import mlx_lm

    with pytest.raises(ValueError):
        EmbeddingRun(model, [[1], []])
    with pytest.raises(ValueError):
        EmbeddingRun(model, [[1]], "max")
    echo = mlx_lm.load(str(echo_model_dir))[0]
    with pytest.raises(NoHiddenStates):
        EmbeddingRun(echo, [[1, 2]])


async def test_a_running_stream_gets_a_token_between_every_two_slices(random_model_dir: Path) -> None:
    """One 1,500-token input with ``embedding_step=64``: the thread alternates a
    decode step and a slice, so the stream running beside it gets a token for
    (nearly) every one of the 24 slices; computed whole, it got one."""
    async with open_engine(random_model_dir, embedding_step=64, warmup=False) as engine:
        long = [random.Random(0).randrange(20, 1000) for _ in range(1500)]
        gen = CompletionRequest.from_openai({"max_tokens": 3000, "ignore_eos": True,
                                             "temperature": 0}, [5, 6, 7])
        async with engine.stream(gen) as stream:
            first = await stream.next_batch()  # decoding
            assert first is not None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_drain, stream)
                before = engine.statistics().generation_tokens
                got = await engine.embed([long])
                during = engine.statistics().generation_tokens - before
                nursery.cancel_scope.cancel()
        assert len(got.vectors) == 1 and got.prompt_tokens == 1500
        assert during >= 20, during


async def _drain(stream: Any) -> None:
    async for _ in stream.batches():
        pass


async def test_a_caller_that_leaves_stops_the_slices(random_model_dir: Path) -> None:
    async with open_engine(random_model_dir, embedding_step=16, warmup=False) as engine:
        long = [[random.Random(i).randrange(20, 1000) for _ in range(3000)] for i in range(4)]
        with trio.move_on_after(0.2):
            await engine.embed(long)
        assert engine.statistics().embeddings_active == 0
        # the thread dropped it: the next call is answered (after at most one slice of the old one)
        got = await engine.embed("short")
        assert len(got.vectors) == 1
