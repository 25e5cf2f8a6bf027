"""afm_core._mlx.attention: the decode attention kernel against MLX's own.

The kernel computes the same softmax(scale q k^T + mask) v as
``mx.fast.scaled_dot_product_attention`` for one query position, summing in
another order and with its own exponential (about 2 ulp), so the two agree
to float32 rounding: 2e-6 of the largest |v| here (values of order 1).
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
    with pytest.raises(ValueError, match="one query position"):
        ext.decode_attention(mx.concatenate([q, q], axis=2), k, v, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        ext.decode_attention(q, mx.concatenate([k, k[:, :1]], axis=1),
                             mx.concatenate([v, v[:, :1]], axis=1), 1.0)
    with pytest.raises(ValueError, match="float32"):
        ext.decode_attention(q.astype(mx.float16), k, v, 1.0)
    with pytest.raises(ValueError, match="bool or float32"):
        ext.decode_attention(q, k, v, 1.0, mx.ones((8,), dtype=mx.int32))
    with pytest.raises(ValueError):
        ext.decode_attention(q, k, v, 1.0, mx.ones((7,), dtype=mx.bool_))  # does not broadcast


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
    q2 = mx.random.normal((1, 4, 3, 16))  # three positions: mlx-lm's path
    sdpa(q2, k, v, cache=None, scale=0.5, mask="causal")
    sdpa(q.astype(mx.bfloat16), k.astype(mx.bfloat16), v.astype(mx.bfloat16),
         cache=None, scale=0.5, mask=None)

    class QuantizedCache:  # mlx-lm's quantized KV cache has its own attention
        bits, group_size = 8, 64

    assert not _attention._applies(q, k, v, QuantizedCache(), None, None)
    assert not _attention._applies(q, k, v, None, None, mx.zeros((4,)))  # attention sinks
    assert len(calls) == 1


@needs_ext
def test_use_and_restore_count_the_models_per_module(tmp_path, monkeypatch):
    import mlx_lm.models.qwen3 as qwen3  # the random test model's architecture
    from mlx_lm.utils import load_model

    from afm_core.testing import make_random_model

    # start from no user (an earlier test's model may still hold the module)
    monkeypatch.setattr(_attention, "_users", {})
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
