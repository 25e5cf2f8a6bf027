"""Pooled hidden states: equal to a direct computation, the same alone and in a group."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from afm_core._mlx import embeddings
from afm_core._mlx.embeddings import NoHiddenStates, embed


@pytest.fixture(scope="module")
def model(random_model_dir: Path) -> Any:
    import mlx_lm

    return mlx_lm.load(str(random_model_dir))[0]


def direct(model: Any, ids: list[int], pooling: str) -> np.ndarray:
    """The final hidden states computed layer by layer, pooled and normalized in numpy."""
    body = model.model
    h = body.embed_tokens(mx.array([ids]))
    for layer in body.layers:
        h = layer(h, "causal" if len(ids) > 1 else None, None)
    states = np.array(body.norm(h).astype(mx.float32))[0]
    v = {"mean": states.mean(axis=0), "last": states[-1], "cls": states[0]}[pooling]
    return v / np.linalg.norm(v)


def texts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.choice([1, 2, 5, 17, 40]))] for _ in range(n)]


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_pooling_equals_direct_computation(model: Any, pooling: str) -> None:
    inputs = texts(6)
    got = embed(model, inputs, pooling)
    assert len(got) == len(inputs)
    for ids, vec in zip(inputs, got, strict=True):
        assert len(vec) == model.args.hidden_size
        assert np.linalg.norm(vec) == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(vec, direct(model, ids, pooling), atol=1e-5)


def test_poolings_differ(model: Any) -> None:
    ids = [[5, 6, 7, 8, 9]]
    mean, last, cls = (embed(model, ids, p)[0] for p in ("mean", "last", "cls"))
    assert not np.allclose(mean, last) and not np.allclose(mean, cls) and not np.allclose(last, cls)


def test_batch_equals_alone(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = texts(9, seed=1)
    alone = [embed(model, [ids])[0] for ids in inputs]
    together = embed(model, inputs)
    np.testing.assert_allclose(together, alone, atol=1e-5)
    # several groups (a small token budget per forward pass): same vectors, same order
    monkeypatch.setattr(embeddings, "GROUP_TOKENS", 50)
    np.testing.assert_allclose(embed(model, inputs), alone, atol=1e-5)
    # the same text twice in one call
    twice = embed(model, [inputs[0], inputs[0]])
    np.testing.assert_allclose(twice[0], twice[1], atol=1e-6)


def test_refusals(model: Any, echo_model_dir: Path) -> None:
    import mlx_lm

    with pytest.raises(ValueError, match="pooling"):
        embed(model, [[1, 2]], "max")
    with pytest.raises(ValueError, match="no tokens"):
        embed(model, [[1], []])
    echo = mlx_lm.load(str(echo_model_dir))[0]
    assert not embeddings.has_body(echo)
    with pytest.raises(NoHiddenStates):
        embed(echo, [[1, 2]])
