"""afm_core._mlx.decode_layout: mlx-lm's llama, qwen2, qwen3 and Gemma 3
layers at decode, with fewer operations, give mlx-lm's bits."""

from __future__ import annotations

import collections
import importlib
import re
import tempfile
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import batch, decode_layout, fusion, half_cache
from afm_core._mlx import qmatmul as _qmatmul

ext = _qmatmul.extension()
needs_ext = pytest.mark.skipif(ext is None, reason="afm_core._mlx.qmm_ext is not built or disabled")


def mixed_bits(path: str, module: nn.Module) -> bool | dict[str, int]:
    """4 bits, and 8 for the values and down products (as Q4_K_M files keep
    some at 6): the q/k/v family is then left apart."""
    if not hasattr(module, "to_quantized"):
        return False
    return {"group_size": 32, "bits": 8} if path.endswith(("v_proj", "down_proj")) else True


def tiny(kind: str, *, quantized: bool | str) -> Any:
    module = importlib.import_module(f"mlx_lm.models.{kind}")
    args = {"model_type": kind, "hidden_size": 96, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 6, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 300,
            "rope_theta": 10000.0, "tie_word_embeddings": True}
    if kind == "qwen3":
        args.update(head_dim=16, max_position_embeddings=4096)
    if kind == "gemma3_text":  # a sliding layer then a global one; the window wraps within a test
        args.update(head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16)
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(args))
    if quantized:
        nn.quantize(model, group_size=32, bits=4, class_predicate=mixed_bits if quantized == "mixed" else None)
    mx.eval(model.parameters())
    return model


def primitives(out: mx.array) -> collections.Counter[str]:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        graph = f.read()
    return collections.Counter(re.findall(r'label ?= ?"([A-Za-z][^"]*)", shape=rectangle', graph))


WINDOW = 8
"""The tiny Gemma 3's sliding window: its prompt and decode steps pass it."""


def cache_of(model: Any, rows: int) -> list[Any]:
    """The model's caches for one row, or a batch of two (the second left-padded by 3)."""
    if rows == 1:
        return make_prompt_cache(model)  # type: ignore[no-any-return]
    return [BatchRotatingKVCache(WINDOW, [0, 3]) if getattr(layer.self_attn, "is_sliding", False)
            else BatchKVCache([0, 3]) for layer in model.layers]


def decode(model: Any, rows: int, half: bool = False,
           steps: tuple[int, ...] = (8, 200, 45, 3)) -> tuple[list[np.ndarray], collections.Counter[str]]:
    """A prompt, then decode steps: every step's logits, and the last
    step's operations; ``half``: on float16 caches (:mod:`.half_cache`)."""
    cache = cache_of(model, rows)
    if half:
        half_cache.to_half(cache)
    outs = [model(mx.array([[5, 17, 256, 3, 99, 41], [0, 0, 0, 12, 7, 31]][:rows]), cache=cache)]
    mx.eval(outs)
    ops: collections.Counter[str] = collections.Counter()
    for t in steps:
        outs.append(model(mx.array([[t]] * rows), cache=cache))
        ops = primitives(outs[-1])
        mx.eval(outs)
    return [np.array(o) for o in outs], ops


def swap(model: Any, layouts: bool) -> None:
    (decode_layout.use_decode_layout if layouts else decode_layout.restore_decode_layout)(model)


@needs_ext
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantized", [False, True, "mixed"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("half", [False, True])
def test_the_layouts_give_mlx_lm_bits_with_fewer_operations(kind: str, quantized: bool | str, rows: int,
                                                            half: bool) -> None:
    """Eight operations fewer per layer (the four transposes, the output's
    reshape, the two slices of the cache, and the queries' and keys' rotary
    embeddings in one); with afm's quantized products seven more (the q/k/v
    product shapes the heads, the epilogues add the residuals, the
    prologues compute the norms), and for llama and qwen2 one more (the
    rotary embeddings in the q/k/v product's epilogue); with a float16
    cache two more (a write for each buffer's cast and update).  ``mixed``: the values' product at 8
    bits, so the q/k/v family is left apart: each product shapes its heads
    and computes the norm in its prologue all the same."""
    model = tiny(kind, quantized=quantized)
    fusion.fuse_cpu_kernels(model, transpose=False)
    block, attention = model.layers[0], model.layers[0].self_attn
    assert (type(attention.v_proj) is _qmatmul._FastQuantizedLinear) == (quantized == "mixed")  # (not grouped)
    assert type(block).__name__ == "TransformerBlock" and type(block).__mro__[1].__name__ == "TransformerBlock"
    assert "DecodeLayout" in type(block).__qualname__ and "DecodeLayout" in type(attention).__qualname__
    ours, ops = decode(model, rows, half)
    swap(model, False)
    assert "DecodeLayout" not in type(block).__qualname__ + type(attention).__qualname__
    theirs, their_ops = decode(model, rows, half)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    # llama's and qwen2's q/k/v family (no per-head norms) embeds the
    # queries' and keys' positions in its product's epilogue: one more
    in_product = quantized is True and kind != "qwen3"
    fewer = 8 + 7 * bool(quantized) + 2 * half + in_product
    assert ops["Slice"] == 0 < their_ops["Slice"]  # the cache's buffers are read in place
    assert (ops["AfmRopeDecode"], their_ops["AfmRopeDecode"]) == \
        (0 if in_product else len(model.layers), 2 * len(model.layers))
    assert ops["AfmKvWrite"] == (2 * len(model.layers) if half else 0)
    assert sum(their_ops.values()) - sum(ops.values()) == fewer * len(model.layers)
    if quantized:
        assert their_ops["Add"] - ops["Add"] == 2 * len(model.layers)
        # the MLP's activation: the gate/up family's one product either way
        assert ops["AfmQuantizedSwiglu"] == their_ops["AfmQuantizedSwiglu"] == len(model.layers)
        # the block's norms in the q/k/v and gate/up products' prologues: the
        # model's final one is left (and qwen3's per-head query and key norms)
        left = 1 + (2 * len(model.layers) if kind == "qwen3" else 0)
        assert (ops["AfmRMSNorm"], their_ops["AfmRMSNorm"]) == (left, left + 2 * len(model.layers))
    swap(model, True)
    fusion.unfuse_cpu_kernels(model)
    assert "DecodeLayout" not in type(block).__qualname__ + type(attention).__qualname__


@needs_ext
def test_the_switch_keeps_mlx_lm_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(decode_layout.NO_DECODE_LAYOUT_ENV, "1")
    model = tiny("llama", quantized=True)
    assert decode_layout.use_decode_layout(model) == 0
    assert all("DecodeLayout" not in type(m).__qualname__ for _, m in model.named_modules())


def test_a_block_whose_parts_differ_keeps_mlx_lm_call() -> None:
    """A block whose MLP is not mlx-lm's (a mixture of experts, a wrapper)
    keeps its call; its attention still takes the layout."""
    model = tiny("qwen2", quantized=False)

    class OtherMLP(nn.Module):
        def __init__(self, mlp: Any) -> None:
            super().__init__()
            self.inner = mlp

        def __call__(self, x: mx.array) -> mx.array:
            return self.inner(x)

    model.layers[0].mlp = OtherMLP(model.layers[0].mlp)
    assert decode_layout.use_decode_layout(model) == 2 * len(model.layers) - 1
    assert "DecodeLayout" not in type(model.layers[0]).__qualname__
    assert "DecodeLayout" in type(model.layers[0].self_attn).__qualname__
    assert "DecodeLayout" in type(model.layers[1]).__qualname__
    assert decode_layout.restore_decode_layout(model) == 2 * len(model.layers) - 1


@needs_ext
@pytest.mark.parametrize("rows", [1, 3, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_residual_product_is_the_bits_of_adding_after(rows: int, bias: bool) -> None:
    """One operation where the kernels apply (float32, the bias fused or
    none), a residual of any strides; ``residual + layer(x)`` otherwise."""
    mx.random.seed(rows)
    layer = nn.QuantizedLinear(128, 96, bias=bias, group_size=32, bits=4)
    layer.__class__ = _qmatmul._FastQuantizedLinear
    x = mx.random.normal((rows, 1, 128))
    residuals = [mx.random.normal((rows, 1, 96)), mx.random.normal((96, rows)).T.reshape(rows, 1, 96)]
    mx.eval(x, residuals, layer.parameters())
    for residual in residuals:
        got = _qmatmul.residual_product(layer, x, residual)
        assert primitives(got) == {"AfmQuantizedMatmul": 1}
        np.testing.assert_array_equal(np.array(got), np.array(residual + layer(x)))
    half = _qmatmul.residual_product(layer, x.astype(mx.float16), residual.astype(mx.float16))
    assert "Add" in primitives(half)  # (not fused: float16)
    np.testing.assert_array_equal(np.array(half), np.array(residual.astype(mx.float16) + layer(x.astype(mx.float16))))
    with pytest.raises(ValueError):
        assert ext is not None
        ext.quantized_matmul(x, layer["weight"], layer["scales"], layer["biases"], 32, 4, None,
                             mx.zeros((rows, 1, 95)))


@needs_ext
@pytest.mark.parametrize("batch", [False, True])
def test_kv_write_is_the_casts_and_slice_updates(batch: bool) -> None:
    """The same float16 buffers as mlx-lm's update of a float16 cache, from
    keys of any strides; as with mlx-lm's item assignment every holder of the
    cache's array object sees the write (a row merged into a batch shares
    them), and a view of the old buffer keeps what it held (the buffer is
    copied, not written); a cache without room grows through mlx-lm's update."""
    mx.random.seed(1)
    k0, v0 = mx.random.normal((2, 3, 5, 16)), mx.random.normal((2, 3, 5, 8))

    def fresh() -> Any:
        cache = half_cache.BatchKVCache([0, 2]) if batch else half_cache.KVCache()
        cache.update_and_fetch(k0, v0)  # buffers of 256 positions, 5 used
        mx.eval(cache.keys, cache.values)
        return cache

    for n in (1, 2):
        k = mx.random.normal((2, n, 3, 16)).transpose(0, 2, 1, 3)  # strided, as mlx-lm makes them
        v = mx.random.normal((2, 3, n, 8))
        ours, theirs = fresh(), fresh()
        held, view = ours.keys, ours.keys[:, :, :8]
        before = np.array(view)
        got = decode_layout.update_and_fetch(ours, k, v)
        want = theirs.update_and_fetch(k, v)
        assert primitives(got[0])["AfmKvWrite"] == primitives(got[1])["AfmKvWrite"] == 1
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
        assert held is ours.keys  # the same object, now the written buffer
        np.testing.assert_array_equal(np.array(held), np.array(theirs.keys))
        np.testing.assert_array_equal(np.array(view), before)  # the view's buffer was copied, not written
        assert (ours._idx if batch else ours.offset) == 5 + n
        if batch:
            assert (ours.offset == theirs.offset).all().item()
    full = fresh()
    big = mx.zeros((2, 3, 260, 16)), mx.zeros((2, 3, 260, 8))
    got = decode_layout.update_and_fetch(full, *big)  # no room: mlx-lm's growth
    assert got[0].shape[2] == 265 and "AfmKvWrite" not in primitives(got[0])
    assert ext is not None
    with pytest.raises(ValueError):
        ext.kv_write(full.keys, mx.zeros((2, 3, 1, 15)), 0)
    with pytest.raises(ValueError):
        ext.kv_write(full.keys, mx.zeros((2, 3, 1, 16)), 10_000)
    with pytest.raises(ValueError):
        ext.kv_write(full.keys.astype(mx.float32), mx.zeros((2, 3, 1, 16)), 0)


@needs_ext
@pytest.mark.parametrize("batch", [False, True])
def test_kv_write_writes_a_buffer_nothing_else_holds_in_place(batch: bool) -> None:
    """As mlx-lm's slice update does: decoding must not copy the whole cache every step."""

    def address(a: mx.array) -> int:
        return int(np.asarray(memoryview(a)).__array_interface__["data"][0])

    cache = half_cache.BatchKVCache([0]) if batch else half_cache.KVCache()
    cache.update_and_fetch(mx.zeros((1, 3, 5, 16)), mx.zeros((1, 3, 5, 8)))
    mx.eval(cache.keys, cache.values)
    seen = {(address(cache.keys), address(cache.values))}
    for _ in range(4):
        k, v = decode_layout.update_and_fetch(cache, mx.ones((1, 3, 1, 16)), mx.ones((1, 3, 1, 8)))
        total = k.sum() + v.sum()
        del k, v
        mx.eval(total)
        seen.add((address(cache.keys), address(cache.values)))
    assert len(seen) == 1 and total.item() == 4 * 3 * (16 + 8)  # the four written positions


@needs_ext
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_a_norm_prologue_is_the_bits_of_the_norm_first(rows: int) -> None:
    """The split and SwiGLU products of ``rms_norm(x)`` with the norm in
    their prologue: the bits of the norm operation's output multiplied, for
    rows on the integer kernels and on sgemm, x of any strides."""
    assert ext is not None
    mx.random.seed(rows)
    w = mx.random.normal((192, 128))
    wq, scales, biases = mx.quantize(w, group_size=32, bits=4)
    weight = mx.random.normal((128,))
    bias = [mx.random.normal((96,)), None]
    for x in (mx.random.normal((rows, 1, 128)), mx.random.normal((128, rows)).T.reshape(rows, 1, 128)):
        normed = ext.rms_norm(x, weight, 1e-5)
        got = ext.quantized_matmul_split(x, wq, scales, biases, 32, 4, [96, 96], bias, weight, 1e-5)
        want = ext.quantized_matmul_split(normed, wq, scales, biases, 32, 4, [96, 96], bias)
        assert primitives(got[0])["AfmRMSNorm"] == 0
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
        np.testing.assert_array_equal(
            np.array(ext.quantized_matmul_swiglu(x, wq, scales, biases, 32, 4, weight, 1e-5)),
            np.array(ext.quantized_matmul_swiglu(normed, wq, scales, biases, 32, 4)))
    with pytest.raises(ValueError, match="norm"):
        ext.quantized_matmul_swiglu(x.astype(mx.float16), wq, scales, biases, 32, 4, weight, 1e-5)
    with pytest.raises(ValueError, match="norm"):
        ext.quantized_matmul_split(x, wq, scales, biases, 32, 4, [192], [], weight[:64], 1e-5)


@needs_ext
def test_norms_on_mlx_kernels_stay_outside_the_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``AFM_NO_LAYER_OPS=1`` the norms are MLX's compiled kernels: a
    product's prologue (the extension's norm) would not give their bits, so
    they stay operations of their own."""
    monkeypatch.setenv(fusion.NO_LAYER_OPS_ENV, "1")
    model = tiny("llama", quantized=True)
    fusion.fuse_cpu_kernels(model, transpose=False)
    ours, ops = decode(model, 1)
    swap(model, False)
    theirs, _ = decode(model, 1)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    assert "AfmRMSNorm" not in ops and ops["Multiply"] >= 2 * len(model.layers)  # (the norms' graphs)
    assert not any(layer.input_layernorm._one_operation for layer in model.layers)


@needs_ext
def test_a_batch_merged_from_a_row_is_written_in_place_while_the_row_lives() -> None:
    """A single row's merge into a decode batch adopts the row's buffers (the
    same array objects), and the row's cache may still be alive: the write
    must still take the buffer over, not copy the whole cache every step
    (it did once, 98 MiB more at an 8,000-token prompt's first tokens)."""

    def address(a: mx.array) -> int:
        return int(np.asarray(memoryview(a)).__array_interface__["data"][0])

    row = half_cache.KVCache()
    half_cache.reserve([row], 300)
    row.update_and_fetch(mx.zeros((1, 3, 40, 16)), mx.zeros((1, 3, 40, 8)))
    mx.eval(row.keys, row.values)
    batch = half_cache.BatchKVCache.merge([row])
    assert batch.keys is row.keys  # adopted
    seen = {(address(batch.keys), address(batch.values))}
    for _ in range(3):
        decode_layout.update_and_fetch(batch, mx.ones((1, 3, 1, 16)), mx.ones((1, 3, 1, 8)), fetch=False)
        mx.eval(batch.keys, batch.values)
        seen.add((address(batch.keys), address(batch.values)))
    assert len(seen) == 1 and row.keys is batch.keys


@needs_ext
@pytest.mark.parametrize("quantized", [False, True, "mixed"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("half", [False, True])
def test_gemma3_layouts_give_mlx_lm_bits_with_fewer_operations(quantized: bool | str, rows: int,
                                                               half: bool) -> None:
    """Gemma 3's layers (a sliding-window layer on a rotating cache, which
    wraps here, then a global one): the attention's layout as qwen3's (the
    sliding layer reads the cache mlx-lm's rotating update returns), the
    block's input and pre-feedforward norms in the products' prologues."""
    model = tiny("gemma3_text", quantized=quantized)
    fusion.fuse_cpu_kernels(model, transpose=False)
    sliding, full = model.layers
    assert (type(full.self_attn.v_proj) is _qmatmul._FastQuantizedLinear) == (quantized == "mixed")
    assert sliding.self_attn.is_sliding and not full.self_attn.is_sliding
    for block in model.layers:
        assert "DecodeLayout" in type(block).__qualname__ + type(block.self_attn).__qualname__
        assert fusion.one_operation_norm(block.input_layernorm) is not None
    steps = tuple(range(20, 20 + 2 * WINDOW))  # the prompt's 6 positions and 16 more: the window wraps twice
    ours, ops = decode(model, rows, half, steps)
    caches = (RotatingKVCache, BatchRotatingKVCache)
    swap(model, False)
    assert all("DecodeLayout" not in type(m).__qualname__ for _, m in model.named_modules())
    theirs, their_ops = decode(model, rows, half, steps)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    # per layer pair: the four transposes each; the queries' and keys' rotary
    # embeddings in one each; both layers read their buffers in place (no
    # slices: the global layer's, and the sliding one's until its window
    # fills) with the output as (B, 1, H x D) (two reshapes); with afm's
    # quantized products the q/k/v product shapes the heads (six reshapes)
    # and the input and pre-feedforward norms are the products' prologues
    # (four); with a float16 cache, the global layer's two writes
    assert sum(their_ops.values()) - sum(ops.values()) == 14 + 10 * bool(quantized) + 2 * half
    assert (ops["Slice"], ops["AfmRopeDecode"], ops["AfmKvWrite"]) == (0, 2, 2 * half)
    assert (their_ops["Transpose"] - ops["Transpose"], their_ops["AfmRopeDecode"]) == (8, 4)
    if quantized:  # the model's final norm, and each layer's query, key and two post-norms
        assert (ops["AfmRMSNorm"], their_ops["AfmRMSNorm"]) == (9, 13)
    assert type(cache_of(model, rows)[0]) in caches  # (the sliding layer's: rotating)
    early = decode(model, rows, half, steps[:1])[1]  # the sliding window not yet full: mlx-lm slices it
    swap(model, True)
    early_ours = decode(model, rows, half, steps[:1])[1]
    assert early["Slice"] == 4 and early_ours["Slice"] == 0
    swap(model, True)
    fusion.unfuse_cpu_kernels(model)
    assert all("DecodeLayout" not in type(m).__qualname__ and "Fused" not in type(m).__qualname__
               for _, m in model.named_modules())


@needs_ext
@pytest.mark.parametrize("quantized", [False, True])
def test_gemma3_sliding_layers_sharing_one_offset_drop_their_own(quantized: bool) -> None:
    """A batch's sliding-window layers after ``batch.share_offsets``: each
    but the first writes its cache without mlx-lm's ``mx.depends`` while
    its window fills (its own offset's broadcast and addition are dropped
    at the next share); mlx-lm's update where it grows, rotates or does not
    share, the same bits at every step, before and after the windows wrap."""
    window = 16
    module = importlib.import_module("mlx_lm.models.gemma3_text")
    args = {"model_type": "gemma3_text", "hidden_size": 96, "num_hidden_layers": 6, "intermediate_size": 128,
            "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
            "vocab_size": 300, "sliding_window": window, "sliding_window_pattern": 3, "query_pre_attn_scalar": 16}
    mx.random.seed(4)
    model = module.Model(module.ModelArgs.from_dict(args))
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    fusion.fuse_cpu_kernels(model, transpose=False)
    sliding = [layer.self_attn.is_sliding for layer in model.layers]
    assert sliding == [True, True, False] * 2

    def run(shared: bool) -> tuple[list[np.ndarray], list[collections.Counter[str]]]:
        cache = [BatchRotatingKVCache(window, [0, 3]) if s else BatchKVCache([0, 3]) for s in sliding]
        outs = [model(mx.array([[5, 17, 256, 3, 99, 41], [0, 0, 0, 12, 7, 31]]), cache=cache)]
        mx.eval(outs)
        ops = []
        for t in range(30, 30 + 2 * window):  # grows at the first step, rotates from the eleventh
            if shared:
                batch.share_offsets(cache)
            outs.append(model(mx.array([[t], [t + 1]]), cache=cache))
            ops.append(primitives(outs[-1]))
            mx.eval(outs)
        return [np.array(o) for o in outs], ops

    ours, ops = run(shared=True)
    alone, alone_ops = run(shared=False)
    swap(model, False)
    theirs, their_ops = run(shared=True)
    for a, b, c in zip(ours, alone, theirs, strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)
    followers = sum(sliding) - 1  # (the first sliding layer keeps mlx-lm's update)
    steady = 4  # a step while the windows fill
    # (and, shared, the second global layer's offset: its broadcast and addition, as before)
    assert sum(alone_ops[steady].values()) - sum(ops[steady].values()) == 3 * followers + 2
    assert (ops[steady]["Depends"], alone_ops[steady]["Depends"], their_ops[steady]["Depends"]) == (
        1, 1 + followers, 1 + followers)
    for step in (0, -1):  # growing, rotated: mlx-lm's update (the global layer's offset still shared)
        assert ops[step]["Depends"] == alone_ops[step]["Depends"] == their_ops[step]["Depends"] == 1 + followers
        assert sum(alone_ops[step].values()) - sum(ops[step].values()) == 2
    swap(model, True)
