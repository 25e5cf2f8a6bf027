"""afm_core._mlx.attention: the decode attention kernel against MLX's own.

The kernel computes the same softmax(scale q k^T + mask) v as
``mx.fast.scaled_dot_product_attention`` for one query position or a few,
summing in another order and with its own exponential (about 2 ulp), so the
two agree to float32 rounding: 2e-6 of the largest |v| here (values of order
1).  Against itself it is exact: position j of an L-position call gives the
bits of a one-position call on the keys up to j, which is what a speculative
verify step needs to stand for the decode steps it replaces.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import attention as _attention
from afm_core._mlx import qmatmul as _qmatmul

ext = _qmatmul.extension()
needs_ext = pytest.mark.skipif(ext is None, reason="afm_core._mlx.qmm_ext is not built or disabled")
TOL = 2e-6


def _qkv(b, hq, hkv, s, d, *, seed=0, strided=False, q_transposed=True):
    mx.random.seed(seed)
    if q_transposed:  # as a model makes it: (B, 1, H, D) -> (B, H, 1, D), not contiguous
        q = mx.random.normal((b, 1, hq, d)).transpose(0, 2, 1, 3)
    else:
        q = mx.random.normal((b, hq, 1, d))
    if strided:  # as a KV cache hands them out: the first s rows of a bigger buffer
        k = mx.random.normal((b, hkv, s + 29, d))[:, :, :s, :]
        v = mx.random.normal((b, hkv, s + 29, d))[:, :, :s, :]
    else:
        k, v = mx.random.normal((b, hkv, s, d)), mx.random.normal((b, hkv, s, d))
    return q, k, v


def _close(got, ref):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert float(mx.max(mx.abs(got - ref))) <= TOL * max(1.0, float(mx.max(mx.abs(ref))))


@needs_ext
@pytest.mark.parametrize(("b", "hq", "hkv", "s", "d"), [
    (1, 9, 3, 1, 64), (1, 9, 3, 64, 64), (2, 9, 3, 257, 64), (3, 4, 4, 7, 48),
    (2, 8, 1, 33, 128), (1, 2, 2, 5, 20),  # 20: not a multiple of 8 (the portable loop)
    (2, 16, 2, 3000, 64),  # long enough to split over the thread pool
])
@pytest.mark.parametrize("strided", [False, True])
def test_matches_mlx_without_mask(b, hq, hkv, s, d, strided):
    q, k, v = _qkv(b, hq, hkv, s, d, strided=strided, seed=s + d)
    scale = d ** -0.5
    _close(ext.decode_attention(q, k, v, scale),
           mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))


@needs_ext
@pytest.mark.parametrize("shape", [(2, 1, 1, 50), (1, 1, 1, 50), (50,), (2, 8, 1, 50)])
def test_boolean_masks_broadcast_as_mlx(shape):
    q, k, v = _qkv(2, 8, 2, 50, 64, strided=True)
    mx.random.seed(3)
    mask = mx.random.uniform(shape=shape) > 0.4
    mask[..., -1] = True  # every row keeps a position
    _close(ext.decode_attention(q, k, v, 0.125, mask),
           mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))


@needs_ext
def test_additive_mask_and_a_row_masked_out():
    q, k, v = _qkv(2, 4, 2, 30, 32)
    add = mx.random.normal((2, 4, 1, 30))
    _close(ext.decode_attention(q, k, v, 0.2, add),
           mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=add))
    none = mx.zeros((2, 1, 1, 30), dtype=mx.bool_)
    none[0] = True  # batch row 1 sees nothing: zeros, where MLX's softmax gives NaN
    out = np.array(ext.decode_attention(q, k, v, 0.2, none))
    assert np.all(out[1] == 0)
    ref = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2))
    np.testing.assert_allclose(out[0], ref[0], atol=TOL)


@needs_ext
def test_contiguous_queries_and_a_non_unit_key_stride():
    q, _, v = _qkv(1, 6, 3, 40, 16, q_transposed=False)
    kt = mx.random.normal((1, 3, 16, 40)).swapaxes(2, 3)  # d not contiguous: the portable loop
    _close(ext.decode_attention(q, kt, v, 0.25),
           mx.fast.scaled_dot_product_attention(q, kt, v, scale=0.25))


@needs_ext
def test_refuses_what_it_does_not_compute():
    q, k, v = _qkv(1, 4, 2, 8, 16)
    with pytest.raises(ValueError, match="query positions"):
        ext.decode_attention(mx.concatenate([q] * 17, axis=2), k, v, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        ext.decode_attention(q, mx.concatenate([k, k[:, :1]], axis=1),
                             mx.concatenate([v, v[:, :1]], axis=1), 1.0)
    with pytest.raises(ValueError, match="float32"):
        ext.decode_attention(q.astype(mx.float16), k, v, 1.0)
    with pytest.raises(ValueError, match="bool or float32"):
        ext.decode_attention(q, k, v, 1.0, mx.ones((8,), dtype=mx.int32))
    with pytest.raises(ValueError):
        ext.decode_attention(q, k, v, 1.0, mx.ones((7,), dtype=mx.bool_))  # does not broadcast


def _queries(b, hq, n, d, seed):
    """(B, Hq, L, D) as a model makes them: transposed from (B, L, Hq, D)."""
    mx.random.seed(seed)
    return mx.random.normal((b, n, hq, d)).transpose(0, 2, 1, 3)


def _left_padded_mask(b, n, s, kind):
    """What mlx-lm's BatchKVCache passes for ``n`` new positions over ``s``
    keys: causal, with row i's first i + 1 positions padding (bool), or that
    as an additive mask with random finite values where it keeps."""
    from mlx_lm.models.base import create_causal_mask

    mask = create_causal_mask(n, offset=s - n, left_padding=mx.arange(b) + 1)
    if kind == "bool":
        return mask
    mx.random.seed(s)
    return mx.where(mask, mx.random.normal(mask.shape), -mx.inf)


@needs_ext
@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("b", [1, 2, 3])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive", "none"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 32), (6, 2, 20)])  # 20: portable
def test_each_position_is_the_one_position_call_to_the_bit(n, b, mask_kind, hq, hkv, d):
    s = 21 + n  # the cache: keys up to and including the n new positions
    q = _queries(b, hq, n, d, seed=n + b)
    _, k, v = _qkv(b, hq, hkv, s, d, strided=True, seed=s + d)
    scale = d ** -0.5
    if mask_kind in ("causal", "none"):
        got = ext.decode_attention(q, k, v, scale, None, mask_kind == "causal")
        masks = [None] * n
    else:
        mask = _left_padded_mask(b, n, s, mask_kind)
        got = ext.decode_attention(q, k, v, scale, mask)
        masks = [mask[..., j:j + 1, :s - n + j + 1] for j in range(n)]
    got = np.array(got)
    for j in range(n):
        seen = s if mask_kind == "none" else s - n + j + 1
        one = ext.decode_attention(q[:, :, j:j + 1], k[:, :, :seen], v[:, :, :seen], scale, masks[j])
        np.testing.assert_array_equal(got[:, :, j:j + 1], np.array(one))


@needs_ext
@pytest.mark.parametrize("n", [2, 5, 16])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive", "none"])
@pytest.mark.parametrize(("b", "hq", "hkv", "s", "d"), [
    (1, 15, 5, 256, 64), (3, 9, 3, 40, 64), (2, 8, 1, 600, 128), (2, 6, 2, 30, 20)])
def test_positions_match_mlx(n, mask_kind, b, hq, hkv, s, d):
    q = _queries(b, hq, n, d, seed=s)
    _, k, v = _qkv(b, hq, hkv, s, d, strided=True, seed=s + n)
    if mask_kind in ("causal", "none"):
        mask = "causal" if mask_kind == "causal" else None
        got = ext.decode_attention(q, k, v, 0.125, None, mask_kind == "causal")
    else:
        mask = _left_padded_mask(b, n, s, mask_kind)
        got = ext.decode_attention(q, k, v, 0.125, mask)
    _close(got, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))


@needs_ext
def test_wrapper_takes_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    real = ext.decode_attention

    class Spy:
        def __getattr__(self, name):
            return getattr(ext, name)

        def decode_attention(self, *a):
            calls.append(a)
            return real(*a)

    monkeypatch.setattr(_qmatmul, "_ext", Spy())
    sdpa = _attention.scaled_dot_product_attention
    q, k, v = _qkv(1, 4, 2, 8, 16)
    _close(sdpa(q, k, v, cache=None, scale=0.5, mask="causal"),
           mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5))
    assert len(calls) == 1 and calls[0][4] is None  # "causal" hides nothing for one position
    q3 = mx.random.normal((1, 4, 3, 16))  # three positions (a verify step): the kernel, causal
    _close(sdpa(q3, k, v, cache=None, scale=0.5, mask="causal"),
           mx.fast.scaled_dot_product_attention(q3, k, v, scale=0.5, mask="causal"))
    assert len(calls) == 2 and calls[1][4] is None and calls[1][5] is True
    q17 = mx.random.normal((1, 4, 17, 16))  # past MAX_QUERY_POSITIONS (a prompt): mlx-lm's path
    sdpa(q17, mx.concatenate([k, k, k], axis=2), mx.concatenate([v, v, v], axis=2),
         cache=None, scale=0.5, mask="causal")
    sdpa(q.astype(mx.bfloat16), k.astype(mx.bfloat16), v.astype(mx.bfloat16),
         cache=None, scale=0.5, mask=None)

    class QuantizedCache:  # mlx-lm's quantized KV cache has its own attention
        bits, group_size = 8, 64

    assert not _attention._applies(q, k, v, QuantizedCache(), None, None)
    assert not _attention._applies(q, k, v, None, None, mx.zeros((4,)))  # attention sinks
    assert len(calls) == 2


@needs_ext
def test_use_and_restore_count_the_models_per_module(tmp_path, monkeypatch):
    import mlx_lm.models.qwen3 as qwen3  # the random test model's architecture
    from mlx_lm.utils import load_model

    from afm_core.testing import make_random_model

    # start from no user (an earlier test's model may still hold the module)
    monkeypatch.setattr(_attention._REBINDING, "users", {})
    monkeypatch.setattr(qwen3, "scaled_dot_product_attention", _attention._original)

    path = make_random_model(tmp_path / "m", hidden_size=64, num_layers=1,
                             intermediate_size=128, seed=1)
    one, _ = load_model(path)
    two, _ = load_model(path)
    original = qwen3.scaled_dot_product_attention
    assert original is _attention._original
    assert _attention.use_decode_attention(one) == 1
    assert _attention.use_decode_attention(two) == 1
    assert qwen3.scaled_dot_product_attention is _attention.scaled_dot_product_attention
    assert _attention.restore_decode_attention(one) == 1
    assert qwen3.scaled_dot_product_attention is _attention.scaled_dot_product_attention
    assert _attention.restore_decode_attention(one) == 0  # twice: nothing more
    assert _attention.restore_decode_attention(two) == 1
    assert qwen3.scaled_dot_product_attention is original


@needs_ext
def test_model_greedy_tokens_and_logits_match_mlx(tmp_path):
    import mlx_lm.models.qwen3 as qwen3
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from afm_core.testing import make_random_model

    path = make_random_model(tmp_path / "m", hidden_size=128, num_layers=2,
                             intermediate_size=256, seed=5)
    model, _ = load_model(path)
    nn.quantize(model, group_size=32, bits=4)

    def decode(steps=16):
        cache = make_prompt_cache(model)
        logits = model(mx.array([[5, 17, 256, 3, 99]]), cache=cache)[:, -1]
        out, tokens = [], []
        for _ in range(steps):
            tokens.append(int(mx.argmax(logits)))
            logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1]
            out.append(np.array(logits))
        return tokens, out

    tokens, ref = decode()
    assert _attention.use_decode_attention(model) == 1
    try:
        assert qwen3.scaled_dot_product_attention is _attention.scaled_dot_product_attention
        got_tokens, got = decode()
    finally:
        _attention.restore_decode_attention(model)
    assert got_tokens == tokens
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4 * max(1.0, float(np.abs(b).max())))


def _fused_model(tmp_path):
    from mlx_lm.utils import load_model

    from afm_core._mlx import fusion
    from afm_core.testing import make_random_model

    path = make_random_model(tmp_path / "m", hidden_size=192, num_layers=2, num_heads=6,
                             num_kv_heads=2, intermediate_size=256, seed=7)
    model, _ = load_model(path)
    nn.quantize(model, group_size=32, bits=4)
    fusion.fuse_cpu_kernels(model, transpose=False)
    return model


def _primitives(out):
    import collections
    import re
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        graph = f.read()
    return collections.Counter(re.findall(r'label ?= ?"([A-Za-z][^"]*)", shape=rectangle', graph))


@needs_ext
def test_off_switches_turn_every_kernel_off(tmp_path, monkeypatch):
    from mlx_lm.models.cache import make_prompt_cache

    from afm_core._mlx import fusion

    monkeypatch.setenv(_attention.NO_DECODE_ATTENTION_ENV, "1")
    monkeypatch.setenv(fusion.NO_LAYER_OPS_ENV, "1")
    model = _fused_model(tmp_path)
    # the kernel's name is module-wide: a model another test left fused (before
    # the switch, which is read when a model is fused) may still route it there
    for module in _attention._REBINDING.modules(model):
        monkeypatch.setattr(module, "scaled_dot_product_attention", _attention._original)
    try:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[5, 17, 256]]), cache=cache))
        for n in (1, 3):
            out = model(mx.array([[4] * n]), cache=cache)
            ops = _primitives(out)
            assert not {"AfmDecodeAttention", "AfmRopeDecode", "AfmRMSNorm"} & set(ops)
            mx.eval(out)
    finally:
        fusion.unfuse_cpu_kernels(model)


@needs_ext
@pytest.mark.parametrize("cache_kind", ["single", "batch"])
def test_model_forward_over_positions_is_the_decode_steps(tmp_path, cache_kind):
    """A forward over L new positions (a verify step) gives, at position j,
    the logits of decoding those tokens one at a time."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from afm_core._mlx import fusion

    model = _fused_model(tmp_path)
    try:
        prompt = [[5, 17, 256, 3, 99, 41, 8], [0, 0, 12, 900, 4, 77, 31]]  # row 1 left-padded
        guesses = [[300, 2, 45, 45, 610, 9, 128, 6, 1000], [7, 7, 512, 33, 80, 4, 1, 99, 2]]
        rows = 1 if cache_kind == "single" else 2

        def fresh():
            if cache_kind == "single":
                cache = make_prompt_cache(model)
            else:
                cache = [BatchKVCache([0, 2]) for _ in model.layers]
            mx.eval(model(mx.array(prompt[:rows]), cache=cache))
            return cache

        for n in (1, 2, 3, 5, 9):
            cache = fresh()
            out = model(mx.array([g[:n] for g in guesses[:rows]]), cache=cache)
            ops = _primitives(out)
            assert ops["AfmDecodeAttention"] == 2  # per layer
            # queries and keys embedded by one operation at one position (afm_core._mlx.decode_layout)
            assert ops["AfmRopeDecode"] == (2 if n == 1 else 4)
            assert "Softmax" not in ops and "Matmul" not in ops
            together = np.array(out)
            cache = fresh()
            for j in range(n):
                one = np.array(model(mx.array([[g[j]] for g in guesses[:rows]]), cache=cache))
                np.testing.assert_array_equal(together[:, j:j + 1], one)
    finally:
        fusion.unfuse_cpu_kernels(model)


@needs_ext
@pytest.mark.parametrize("isa", ext.available_isas() if ext is not None else [])
@pytest.mark.parametrize(("n", "mask_kind"), [(1, "none"), (4, "causal"), (3, "bool")])
def test_float16_keys_and_values_are_widened_exactly(isa, n, mask_kind):
    """A half-precision KV cache: the kernel reads float16 keys and values as
    their exact float32 values, so it gives the bits of a float32 call on them."""
    before = ext.isa()
    ext.set_isa(isa)
    try:
        q = _queries(2, 9, n, 64, seed=n)
        _, k, v = _qkv(2, 9, 3, 70, 64, strided=True, seed=7)
        k16, v16 = k.astype(mx.float16), v.astype(mx.float16)
        mask = _left_padded_mask(2, n, 70, "bool") if mask_kind == "bool" else None
        causal = mask_kind == "causal"
        got = ext.decode_attention(q, k16, v16, 0.125, mask, causal)
        want = ext.decode_attention(q, k16.astype(mx.float32), v16.astype(mx.float32), 0.125, mask, causal)
        np.testing.assert_array_equal(np.array(got), np.array(want))
    finally:
        ext.set_isa(before)
    with pytest.raises(ValueError, match="both float32 or both float16"):
        ext.decode_attention(q, k16, v, 0.125)


def test_a_mask_shared_by_the_layers_is_broadcast_once():
    q, k, _ = _qkv(2, 4, 2, 8, 16)
    mask = mx.array([[True] * 8, [False] * 3 + [True] * 5])[:, None, None, :]
    first = _attention._scores_mask(mask, q, k.shape[2])
    assert first.shape == (2, 4, 1, 8)
    assert _attention._scores_mask(mask, q, k.shape[2]) is first  # the next layer's
    three = mx.random.normal((2, 4, 3, 16))  # a verify step's three positions
    assert _attention._scores_mask(mask, three, k.shape[2]).shape == (2, 4, 3, 8)
    assert _attention._scores_mask(None, q, k.shape[2]) is None
    with pytest.raises(ValueError):
        _attention._scores_mask(mx.ones((3, 8), dtype=mx.bool_), q, k.shape[2])


def test_two_interleaved_masks_are_each_broadcast_once():
    """Gemma 3's sliding-window layers share one mask, its global layers
    another, five of one kind between each of the other."""
    q, k, _ = _qkv(2, 4, 2, 8, 16)
    sliding = mx.array([[True] * 8, [False] * 3 + [True] * 5])[:, None, None, :]
    full = mx.array([[True] * 8, [False] * 2 + [True] * 6])[:, None, None, :]
    a, b = _attention._scores_mask(sliding, q, k.shape[2]), _attention._scores_mask(full, q, k.shape[2])
    for _ in range(3):
        assert _attention._scores_mask(sliding, q, k.shape[2]) is a
        assert _attention._scores_mask(full, q, k.shape[2]) is b
    third = mx.array([[True] * 8, [True] * 8])[:, None, None, :]
    _attention._scores_mask(third, q, k.shape[2])  # (the oldest is let go: two are held)
    assert _attention._scores_mask(full, q, k.shape[2]) is b
    assert _attention._scores_mask(sliding, q, k.shape[2]) is not a
    np.testing.assert_array_equal(np.array(_attention._scores_mask(sliding, q, k.shape[2])), np.array(a))



@needs_ext
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "bool"])
def test_a_cache_buffer_read_in_place_with_its_length(half, mask_kind):
    """``length`` reads the first positions of the buffers (a KV cache's, no
    slices in the graph) and ``merge_heads`` gives (B, 1, Hq x D): the bits
    of the call on the slices, reshaped."""
    q, k, v = _qkv(2, 4, 2, 40, 16)
    if half:
        k, v = k.astype(mx.float16), v.astype(mx.float16)
    mask = None if mask_kind == "none" else mx.array([[True] * 29, [False] * 5 + [True] * 24])[:, None, None, :]
    got = ext.decode_attention(q, k, v, 0.25, mask, False, 29, True)
    want = ext.decode_attention(q, k[:, :, :29], v[:, :, :29], 0.25, mask, False)
    assert got.shape == (2, 1, 64)
    np.testing.assert_array_equal(np.array(got), np.array(want).reshape(2, 1, 64))
    with pytest.raises(ValueError, match="length"):
        ext.decode_attention(q, k, v, 0.25, None, False, 41)
    with pytest.raises(ValueError, match="length"):
        ext.decode_attention(q, k, v, 0.25, None, False, 0)
    with pytest.raises(ValueError, match="merge_heads"):
        ext.decode_attention(mx.zeros((2, 4, 3, 16)), k, v, 0.25, None, True, 29, True)
