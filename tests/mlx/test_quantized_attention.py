"""afm_core._mlx.attention over a quantized KV cache: the one-primitive
decode kernel (``qmm_ext.quantized_decode_attention``) against mlx-lm's
``quantized_scaled_dot_product_attention``.

Both dequantize the same packed integers with the same scales and biases;
they sum in other orders and the kernel has its own exponential (about 2
ulp), so they agree to float32 rounding: 1e-5 of the largest |v| here
(values of order 1, scores of order 10).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask, quantized_scaled_dot_product_attention

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import attention as _attention
from afm_core._mlx import qmatmul as _qmatmul

ext: Any = _qmatmul.extension()
needs_ext = pytest.mark.skipif(ext is None, reason="afm_core._mlx.qmm_ext is not built or disabled")
TOL = 1e-5
STEP = 256  # the caches' allocation step: their arrays are slices of buffers this long


class Cache:
    """What mlx-lm's attention looks at on a quantized cache."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size


def _quantized(b, h, s, d, *, bits, group, seed, strided=True, transposed_words=False):
    """A (data, scales, biases) triple of (b, h, s, d) values; ``strided``: the
    first s positions of a buffer a whole number of steps long (as a cache
    hands them out); ``transposed_words``: the words not contiguous in a row."""
    mx.random.seed(seed)
    n = (s + STEP - 1) // STEP * STEP if strided else s
    w, sc, bi = mx.quantize(mx.random.normal((b, h, n, d)), group_size=group, bits=bits)
    if transposed_words:
        w = mx.contiguous(w.swapaxes(2, 3)).swapaxes(2, 3)
    return tuple(x[:, :, :s, :] for x in (w, sc, bi))


def _query(b, hq, d, *, seed, layout="model"):
    mx.random.seed(seed + 1000)
    if layout == "model":  # (B, 1, H, D) -> (B, H, 1, D), as a model's projection makes it
        return mx.random.normal((b, 1, hq, d)).transpose(0, 2, 1, 3)
    if layout == "columns":  # D not contiguous: the portable loop
        return mx.random.normal((b, d, hq)).transpose(0, 2, 1)[:, :, None, :]
    return mx.random.normal((b, hq, 1, d))


def _reference(q, k, v, scale, mask, group, bits):
    return quantized_scaled_dot_product_attention(q, k, v, scale=scale, mask=mask,
                                                  group_size=group, bits=bits)


def _close(got, ref):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = float(mx.max(mx.abs(got - ref)))
    assert err <= TOL * max(1.0, float(mx.max(mx.abs(ref)))), err


def _left_padding_mask(s, pads):
    """The bool mask mlx-lm's batch caches make for one new position: (B, 1, 1, S)."""
    return create_causal_mask(1, offset=s - 1, left_padding=mx.array(pads))


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("b", "hq", "hkv", "s", "d", "group"), [
    (1, 9, 3, 1, 64, 64), (1, 9, 3, 255, 64, 64), (2, 9, 3, 257, 64, 64), (3, 4, 4, 7, 128, 32),
    (2, 8, 1, 33, 128, 128), (1, 2, 2, 512, 64, 32),
    (1, 9, 3, 3000, 64, 64),  # long enough to split over the thread pool, in parts
    (2, 16, 2, 1100, 128, 64), (1, 10, 1, 300, 64, 32),  # 10 query heads a key head: not unrolled
])
def test_matches_mlx_lm_without_mask(bits, b, hq, hkv, s, d, group):
    k = _quantized(b, hkv, s, d, bits=bits, group=group, seed=s + d)
    v = _quantized(b, hkv, s, d, bits=bits, group=group, seed=s + d + 1)
    q = _query(b, hq, d, seed=s)
    scale = d ** -0.5
    _close(ext.quantized_decode_attention(q, k, v, scale, None, group, bits),
           _reference(q, k, v, scale, None, group, bits))


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("s", [5, 256, 700, 2500])
def test_left_padded_batch_masks(bits, s):
    """A batch of rows of other lengths, right-aligned: each row's padding is masked."""
    pads = [0, 3, s - 1, s // 2]
    k = _quantized(4, 3, s, 64, bits=bits, group=64, seed=s)
    v = _quantized(4, 3, s, 64, bits=bits, group=64, seed=s + 1)
    q = _query(4, 9, 64, seed=s)
    mask = _left_padding_mask(s, pads)
    assert mask.shape == (4, 1, 1, s) and mask.dtype == mx.bool_
    _close(ext.quantized_decode_attention(q, k, v, 0.125, mask, 64, bits),
           _reference(q, k, v, 0.125, mask, 64, bits))


@needs_ext
@pytest.mark.parametrize("shape", [(2, 1, 1, 300), (1, 1, 1, 300), (300,), (1, 300)])
def test_masks_broadcast_as_mlx_lm(shape):
    k = _quantized(2, 2, 300, 64, bits=8, group=64, seed=1)
    v = _quantized(2, 2, 300, 64, bits=8, group=64, seed=2)
    q = _query(2, 8, 64, seed=3)
    mx.random.seed(4)
    keep = mx.random.uniform(shape=shape) > 0.4
    additive = mx.random.normal(shape) * 3
    for mask in (keep, additive):
        assert _attention._applies_quantized(q, k, v, Cache(8, 64), mask, None)
        _close(ext.quantized_decode_attention(q, k, v, 0.2, mask, 64, 8),
               _reference(q, k, v, 0.2, mask, 64, 8))


@needs_ext
def test_a_row_with_every_position_masked_averages_them_as_mlx_lm():
    # mlx-lm puts float32's lowest value where a bool mask is false, so such a
    # row is the mean of its values; the kernel does the same
    k = _quantized(2, 2, 40, 64, bits=4, group=32, seed=5)
    v = _quantized(2, 2, 40, 64, bits=4, group=32, seed=6)
    q = _query(2, 4, 64, seed=7)
    mask = mx.ones((2, 1, 1, 40), dtype=mx.bool_)
    mask[1] = False
    _close(ext.quantized_decode_attention(q, k, v, 0.3, mask, 32, 4),
           _reference(q, k, v, 0.3, mask, 32, 4))


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("hq", "dv"), [(6, 64), (3, 128)])
def test_the_portable_loop_and_other_value_sizes(bits, hq, dv):
    # words not contiguous in a row, or queries with a strided head
    # dimension: the portable loop; values of another head size (mlx-lm
    # reshapes its grouped-query output to the keys' head size: one query
    # head per key head there)
    s = 300
    k = _quantized(2, 3, s, 64, bits=bits, group=32, seed=8, transposed_words=True)
    v = _quantized(2, 3, s, dv, bits=bits, group=32, seed=9)
    for layout in ("columns", "contiguous", "model"):
        q = _query(2, hq, 64, seed=10, layout=layout)
        mask = _left_padding_mask(s, [0, 7])
        got = ext.quantized_decode_attention(q, k, v, 0.125, mask, 32, bits)
        assert got.shape == (2, hq, 1, dv)
        _close(got, _reference(q, k, v, 0.125, mask, 32, bits))
    q = _query(2, hq, 64, seed=10, layout="columns")
    k = _quantized(2, 3, s, 64, bits=bits, group=32, seed=8)
    _close(ext.quantized_decode_attention(q, k, v, 0.125, None, 32, bits),
           _reference(q, k, v, 0.125, None, 32, bits))


@needs_ext
def test_refuses_what_it_does_not_compute():
    k = _quantized(1, 2, 8, 64, bits=8, group=64, seed=0)
    v = _quantized(1, 2, 8, 64, bits=8, group=64, seed=1)
    q = _query(1, 4, 64, seed=0)
    qa = ext.quantized_decode_attention
    with pytest.raises(ValueError, match="one query position"):
        qa(mx.concatenate([q, q], axis=2), k, v, 1.0, None, 64, 8)
    with pytest.raises(ValueError, match="float32"):
        qa(q.astype(mx.float16), k, v, 1.0, None, 64, 8)
    with pytest.raises(ValueError, match="bits"):
        qa(q, k, v, 1.0, None, 64, 3)
    with pytest.raises(ValueError, match="group_size"):
        qa(q, k, v, 1.0, None, 32, 8)  # scales of groups of 64 for groups of 32
    with pytest.raises(ValueError, match="multiple"):
        q3 = _query(1, 3, 64, seed=0)
        qa(q3, k, v, 1.0, None, 64, 8)
    with pytest.raises(ValueError, match="bool or float32"):
        qa(q, k, v, 1.0, mx.ones((8,), dtype=mx.int32), 64, 8)
    with pytest.raises(ValueError):
        qa(q, k, v, 1.0, mx.ones((7,), dtype=mx.bool_), 64, 8)  # does not broadcast
    half = tuple(x.astype(mx.float16) if i else x for i, x in enumerate(k))
    with pytest.raises(ValueError, match="float32"):
        qa(q, half, v, 1.0, None, 64, 8)


def _spy(calls, pick=lambda args: args):
    """The extension, its ``quantized_decode_attention`` recording ``pick(args)`` of each call."""
    real = ext.quantized_decode_attention

    class Spy:
        def __getattr__(self, name):
            return getattr(ext, name)

        def quantized_decode_attention(self, *a):
            calls.append(pick(a))
            return real(*a)

    return Spy()


@needs_ext
def test_wrapper_takes_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    monkeypatch.setattr(_qmatmul, "_ext", _spy(calls))
    sdpa = _attention.scaled_dot_product_attention
    k = _quantized(1, 2, 20, 64, bits=8, group=64, seed=0)
    v = _quantized(1, 2, 20, 64, bits=8, group=64, seed=1)
    q = _query(1, 4, 64, seed=2)
    cache = Cache(8, 64)
    _close(sdpa(q, k, v, cache=cache, scale=0.5, mask="causal"),
           _reference(q, k, v, 0.5, "causal", 64, 8))
    assert len(calls) == 1 and calls[0][4] is None  # "causal" hides nothing for one position
    _close(sdpa(q, list(k), list(v), cache=cache, scale=0.5, mask=None),
           _reference(q, k, v, 0.5, None, 64, 8))
    assert len(calls) == 2
    # mlx-lm's path: several positions; float16 queries; a mask with a head
    # axis of the query heads (mlx-lm lines it up with the key heads)
    sdpa(mx.random.normal((1, 4, 3, 64)), k, v, cache=cache, scale=0.5, mask="causal")
    sdpa(q.astype(mx.float16), k, v, cache=cache, scale=0.5, mask=None)
    assert not _attention._applies_quantized(q, k, v, cache, mx.ones((1, 4, 1, 20), dtype=mx.bool_), None)
    assert not _attention._applies_quantized(q, k, v, cache, mx.ones((2, 1, 20), dtype=mx.bool_), None)
    assert not _attention._applies_quantized(q, k, v, cache, None, mx.zeros((4,)))  # sinks
    assert not _attention._applies_quantized(q, k, v, Cache(6, 64), None, None)
    assert not _attention._applies_quantized(q, k, v, None, None, None)
    assert len(calls) == 2


@needs_ext
@pytest.mark.parametrize("bits", [8, 4])
def test_model_greedy_tokens_and_logits_match_mlx_lm(tmp_path, bits):
    """A tiny random model decoding a left-padded batch on the batched
    quantized cache: the same greedy tokens as mlx-lm's quantized attention;
    logits within float rounding at 8 bits.  At 4 bits a rounding difference
    in one layer's output can move a later layer's new key or value element
    across a quantization boundary (seen here: one 4-bit element of a value
    row one level apart, the logits of its row 0.015 apart from the first
    step), so there the logits agree to that noise: 0.05 of their scale."""
    import mlx_lm.models.qwen3 as qwen3
    from mlx_lm.generate import _merge_caches
    from mlx_lm.utils import load_model

    from afm_core._mlx.quantized_cache import BatchQuantizedKVCache, make_quantized_cache
    from afm_core.testing import make_random_model

    # head size 64 (the group size), 3 query heads per key head
    path = make_random_model(tmp_path / "m", hidden_size=384, num_heads=6, num_kv_heads=2,
                             num_layers=2, intermediate_size=256, seed=5)
    model, _ = load_model(path)
    prompts = [[5, 17, 256, 3, 99, 14, 15, 16, 300], [7, 8, 9], [40, 41, 42, 43, 44]]

    def decode(steps=12):
        rows = []
        for p in prompts:
            cache = make_quantized_cache(model, bits=bits, group_size=64)
            model(mx.array(p[:-1])[None], cache=cache)
            rows.append(cache)
        batch = _merge_caches(rows)
        assert isinstance(batch[0], BatchQuantizedKVCache)
        tokens = [p[-1] for p in prompts]
        out, seen = [], []
        for _ in range(steps):
            logits = model(mx.array(tokens)[:, None], cache=batch)[:, -1]
            out.append(np.array(logits))
            tokens = [int(t) for t in mx.argmax(logits, axis=-1).tolist()]
            seen.append(tokens)
        return seen, out

    ref_tokens, ref = decode()
    assert _attention.use_decode_attention(model) == 1
    calls = []
    try:
        assert qwen3.scaled_dot_product_attention is _attention.scaled_dot_product_attention
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_qmatmul, "_ext", _spy(calls, lambda args: args[-1]))  # the bits
            tokens, got = decode()
    finally:
        _attention.restore_decode_attention(model)
    assert calls and set(calls) == {bits}  # every decode step's layers took the kernel
    assert len(calls) == 2 * 12
    assert tokens == ref_tokens
    for a, b in zip(got, ref, strict=True):
        tol = 1e-4 if bits == 8 else 5e-2
        np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())))


@needs_ext
def test_the_off_switch_leaves_mlx_lm_attention(tmp_path, monkeypatch):
    """``AFM_NO_DECODE_ATTENTION=1``: neither kernel, mlx-lm's function stays."""
    import mlx_lm.models.qwen3 as qwen3
    from mlx_lm.utils import load_model

    from afm_core.testing import make_random_model

    monkeypatch.setattr(_attention._REBINDING, "users", {})
    monkeypatch.setattr(qwen3, "scaled_dot_product_attention", _attention._original)
    model, _ = load_model(make_random_model(tmp_path / "m", hidden_size=64, num_layers=1, seed=1))
    monkeypatch.setenv(_attention.NO_DECODE_ATTENTION_ENV, "1")
    assert _attention.use_decode_attention(model) == 0
    assert qwen3.scaled_dot_product_attention is _attention._original
