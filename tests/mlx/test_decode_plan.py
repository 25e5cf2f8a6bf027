"""afm_core._mlx.decode_plan: a llama or qwen2 block's planned decode step
makes the decode layout's operations with their bits, and steps aside,
having done nothing, wherever the block's general call must decide."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import decode_layout, decode_plan, fusion, half_cache
from tests.mlx.test_decode_layout import cache_of, decode, needs_ext, tiny

pytestmark = needs_ext


@pytest.fixture
def planned_model() -> Iterator[Callable[[str], Any]]:
    """Tiny quantized models with afm's CPU kernels (decode layouts, their
    plans), unfused after the test: fusion rebinds functions of mlx-lm's
    modules that other tests' models call."""
    made: list[Any] = []

    def make(kind: str) -> Any:
        model = tiny(kind, quantized=True)
        fusion.fuse_cpu_kernels(model, transpose=False)
        made.append(model)
        return model

    yield make
    for model in made:
        fusion.unfuse_cpu_kernels(model)


class Spy:
    """Counts the planned steps (calls of ``planned_block`` that made the
    layer) and the declined ones, of planned blocks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made = self.declined = 0
        real = decode_plan.planned_block

        def spy(block: Any, x: mx.array, mask: Any, cache: Any) -> mx.array | None:
            out = real(block, x, mask, cache)
            if out is not None:
                self.made += 1
            elif block.__dict__.get("_afm_decode_plan") is not False:
                self.declined += 1
            return out

        monkeypatch.setattr(decode_layout, "planned_block", spy)


def unplanned(model: Any) -> None:
    for block in model.layers:
        object.__setattr__(block, "_afm_decode_plan", False)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", [1, 2])
def test_the_plan_makes_the_layouts_operations_with_their_bits(kind: str, rows: int, planned_model: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode step of every layer through the plan (qwen2: with the
    q/k/v biases), the same logits bit for bit and the same operations as
    the layout's general call (a single-row and a batch float16 cache)."""
    spy = Spy(monkeypatch)
    planned, planned_ops = decode(planned_model(kind), rows, half=True)
    assert (spy.made, spy.declined) == (4 * 2, 0)  # 4 steps x 2 layers (the prompt is not a decode step)
    model = planned_model(kind)
    unplanned(model)
    general, general_ops = decode(model, rows, half=True)
    assert (spy.made, spy.declined) == (4 * 2, 0)
    assert planned_ops == general_ops
    for a, b in zip(planned, general, strict=True):
        assert np.array_equal(a, b)


def test_a_changed_block_is_decided_again(planned_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A submodule replaced (an output product of mlx-lm's own class) or an
    afm class taken back in place (a norm unfused): the plan steps aside
    and the block's general call decides (the bits of a model never planned,
    changed the same way)."""
    spy = Spy(monkeypatch)
    models = [planned_model("llama"), planned_model("llama")]
    unplanned(models[1])
    mlx_lm = tiny("llama", quantized=True)  # (nn.QuantizedLinear layers, the same weights)
    caches = [half_cache.to_half(cache_of(m, 1)) for m in models]
    steps: list[list[np.ndarray]] = [[], []]

    def step(tokens: list[int]) -> None:
        for m, c, out in zip(models, caches, steps, strict=True):
            out.append(np.array(m(mx.array([tokens]), cache=c)))

    step([5, 17, 256, 3])
    step([9])
    assert (spy.made, spy.declined) == (2, 0)
    for m in models:
        m.layers[0].self_attn.o_proj = mlx_lm.layers[0].self_attn.o_proj
        m.layers[1].post_attention_layernorm.__class__ = nn.RMSNorm
    step([17])
    step([3])
    assert (spy.made, spy.declined) == (2, 4)
    for a, b in zip(*steps, strict=True):
        assert np.array_equal(a, b)


def test_a_cache_without_room_is_left_to_mlx_lm(planned_model: Any) -> None:
    """A float16 cache whose buffers are full (mlx-lm's update grows them)
    and a cache of another kind (mlx-lm's float32 one): the plan declines
    before writing anything."""
    model = planned_model("llama")
    block = model.layers[0]
    cache = half_cache.to_half(cache_of(model, 1))
    mx.eval(model(mx.array([[5, 17, 256, 3]]), cache=cache))
    c = cache[0]
    x = mx.random.normal((1, 1, 96))
    c.keys, c.values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]  # no room left
    offset, keys = c.offset, c.keys
    assert decode_plan.planned_block(block, x, None, c) is None
    assert c.offset == offset and c.keys is keys
    assert decode_plan.planned_block(block, x, None, cache_of(model, 1)[0]) is None


def test_qwen3_blocks_are_not_planned(planned_model: Any) -> None:
    """qwen3 norms each head's query and key between the product and the
    rotary embedding: its blocks keep the layout's general call."""
    model = planned_model("qwen3")
    decode(model, 1, half=True, steps=(8,))
    assert "_afm_decode_plan" not in model.layers[0].__dict__
