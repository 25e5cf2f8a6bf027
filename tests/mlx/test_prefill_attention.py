"""afm_core._mlx.attention for prompts: ``qmm_ext.prefill_attention`` against a
float64 reference and mlx-lm's own attention, on every kernel path.

**The bound** (``_bound``), from the kernel's arithmetic, with u = 2^-24 the
unit roundoff of float32.  A score is ``scale * q . k``: the scaled query
(one rounding) against a key (exact from float16, one rounding from a
quantized triple: ``scale * int + bias``) in a chain of D fused multiply-adds,
so it is off by at most (D + 3) u X, X the largest ``scale * sum |q_d k_d|``
of the row.  Its weight ``e^(score - m)`` is then off by a factor within
e^((D + 3) u X) and the exponential's own 2 ulp (4u); the online softmax
multiplies the running sums by a correction once per tile of 64 keys, both
the values' and the weights' (the same factor, so only its rounding stays:
2u per tile).  Weights each within a relative ε move a weighted average of
the values by at most 2ε max|v|.  The sums over the S keys (values and
weights) are sequential chains, within g_S = S u / (1 - S u) of the sum of
the absolute terms, max|v| for the values once normalised.  So

    |out - exact| <= max|v| (2 ε + 2 g_S),  ε = (D + 3) u X + 4u + 2u ceil(S / 64)

MLX's reference graph (float32 products and softmax) is bounded the same
way, so kernel and mlx-lm differ by at most twice that.  Scores here are
peaked (``scale`` 0.5 on Gaussian q and k of 64: scores of order 4), so a key
shown or hidden by mistake at a mask's edge moves the outputs far beyond the
bound.
"""

from __future__ import annotations

import math
import os
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
ISAS = ext.available_isas() if ext is not None else []
U = 2.0 ** -24
PATHS = {"scalar": "portable", "neon": "portable", "avx2": "avx2", "avx2-vnni": "avx2",
         "avx512-vnni": "avx512"}


# every set this CPU runs, or only the one AFM_QMM_ISA forces (tests/test_kernel_paths.py
# reruns this module once per set that way)
TESTED = [os.environ["AFM_QMM_ISA"]] if os.environ.get("AFM_QMM_ISA") in ISAS else ISAS


@pytest.fixture(params=TESTED)
def isa(request):
    """Each instruction set tested: the kernel path follows the products'."""
    before = ext.isa()
    assert ext.set_isa(request.param)
    yield request.param
    ext.set_isa(before)


def _f64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


def _reference(q, k, v, scale, visible):
    """float64 attention and the kernel's error bound; ``visible`` (B|1, Hq|1, L, S)
    bool says which keys each row sees, ``k`` and ``v`` exact float64 values."""
    q = _f64(q)
    hq, d = q.shape[1], q.shape[3]
    rep = hq // k.shape[1]
    kk, vv = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = kk.shape[2]
    scores = scale * np.einsum("bhld,bhsd->bhls", q, kk)
    vis = np.broadcast_to(visible, scores.shape)
    scores = np.where(vis, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    w = np.where(vis, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = w.sum(axis=-1, keepdims=True)
    out = np.einsum("bhls,bhsd->bhld", w, vv) / np.where(total > 0, total, 1.0)
    x = np.max(np.abs(scale) * np.einsum("bhld,bhsd->bhls", np.abs(q), np.abs(kk)))
    gamma = s * U / (1 - s * U)
    eps = (d + 3) * U * x + 4 * U + 2 * U * math.ceil(s / 64)
    return out, np.max(np.abs(v)) * (2 * eps + 2 * gamma)


def _causal(n, s, window=0):
    rows = np.arange(s - n, s)[:, None]
    cols = np.arange(s)[None]
    vis = cols <= rows
    if window:
        vis &= cols > rows - window
    return vis


def _qkv(b, hq, hkv, n, s, d, *, seed, dtype=mx.float32):
    """q as a model makes it ((B, L, H, D) transposed); k and v the first s
    positions of a cache's longer buffer."""
    mx.random.seed(seed)
    q = mx.random.normal((b, n, hq, d)).transpose(0, 2, 1, 3)
    k = mx.random.normal((b, hkv, s + 37, d)).astype(dtype)[:, :, :s]
    v = mx.random.normal((b, hkv, s + 37, d)).astype(dtype)[:, :, :s]
    return q, k, v


def _check(got, want, bound):
    got = np.array(got, dtype=np.float64)
    assert got.shape == want.shape
    err = np.max(np.abs(got - want))
    assert err <= bound, f"error {err:.3g} above the bound {bound:.3g}"


@needs_ext
def test_the_path_follows_the_instruction_set(isa):
    assert ext.prefill_attention_path(64) == PATHS.get(isa, "portable")
    assert ext.prefill_attention_path(20) == "portable"  # value rows of no whole vectors


@needs_ext
@pytest.mark.parametrize(("b", "hq", "hkv", "n", "s", "d"), [
    (1, 9, 3, 17, 17, 64), (1, 9, 3, 200, 200, 64), (2, 4, 4, 70, 300, 48),
    (1, 12, 2, 130, 1000, 128), (1, 2, 1, 33, 65, 20), (1, 9, 3, 300, 2100, 64)])
def test_causal_matches_float64_and_mlx(isa, b, hq, hkv, n, s, d):
    q, k, v = _qkv(b, hq, hkv, n, s, d, seed=n + s)
    want, bound = _reference(q, _f64(k), _f64(v), 0.5, _causal(n, s))
    got = ext.prefill_attention(q, [k], [v], 0.5, None, True)
    _check(got, want, bound)
    _check(got, np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal"),
                         dtype=np.float64), 2 * bound)


@needs_ext
@pytest.mark.parametrize(("n", "s", "window"), [(40, 40, 16), (300, 500, 64), (200, 700, 333)])
def test_sliding_window_as_flag_and_as_mlx_lm_mask(isa, n, s, window):
    q, k, v = _qkv(1, 6, 2, n, s, 64, seed=window)
    want, bound = _reference(q, _f64(k), _f64(v), 0.5, _causal(n, s, window))
    _check(ext.prefill_attention(q, [k], [v], 0.5, None, True, window), want, bound)
    mask = create_causal_mask(n, s - n, window_size=window)  # what RotatingKVCache passes
    _check(ext.prefill_attention(q, [k], [v], 0.5, mask), want, bound)


@needs_ext
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_left_padded_batch_masks(isa, kind):
    b, n, s = 3, 40, 90
    q, k, v = _qkv(b, 8, 2, n, s, 32, seed=5)
    vis = np.array(create_causal_mask(n, s - n, left_padding=mx.array([0, 7, 50])))
    if kind == "bool":
        mask = mx.array(vis)
        want, bound = _reference(q, _f64(k), _f64(v), 0.5, vis)
    else:
        mx.random.seed(1)
        add = mx.where(mx.array(vis), mx.random.normal(vis.shape), -mx.inf)
        mask = add
        # the additive mask goes into the scores: fold it into the reference's
        want, bound = _reference_additive(q, k, v, 0.5, np.array(add, dtype=np.float64))
    got = ext.prefill_attention(q, [k], [v], 0.5, mask)
    _check(got, want, bound)


def _reference_additive(q, k, v, scale, add):
    qq, kk, vv = _f64(q), _f64(k), _f64(v)
    rep = qq.shape[1] // kk.shape[1]
    kk, vv = np.repeat(kk, rep, axis=1), np.repeat(vv, rep, axis=1)
    with np.errstate(invalid="ignore"):
        scores = scale * np.einsum("bhld,bhsd->bhls", qq, kk) + add
    vis = np.isfinite(scores)
    top = np.where(vis, scores, -np.inf).max(axis=-1, keepdims=True)
    w = np.where(vis, np.exp(np.where(vis, scores, 0.0) - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = w.sum(axis=-1, keepdims=True)
    out = np.einsum("bhls,bhsd->bhld", w, vv) / np.where(total > 0, total, 1.0)
    s, d = kk.shape[2], qq.shape[3]
    x = np.max(np.abs(scale) * np.einsum("bhld,bhsd->bhls", np.abs(qq), np.abs(kk)))
    x += np.max(np.abs(np.where(np.isfinite(add), add, 0.0)))
    gamma = s * U / (1 - s * U)
    eps = (d + 4) * U * x + 4 * U + 2 * U * math.ceil(s / 64)
    return out, np.max(np.abs(vv)) * (2 * eps + 2 * gamma)


@needs_ext
def test_a_row_that_sees_nothing_is_zeros(isa):
    q, k, v = _qkv(2, 4, 2, 20, 30, 16, seed=3)
    mask = mx.array(np.broadcast_to(np.arange(2)[:, None, None, None] == 0, (2, 1, 20, 30)))
    out = np.array(ext.prefill_attention(q, [k], [v], 0.5, mask))
    assert np.all(out[1] == 0)
    want, bound = _reference(q[:1], _f64(k[:1]), _f64(v[:1]), 0.5, np.ones((20, 30), bool))
    _check(out[:1], want, bound)


@needs_ext
def test_no_mask_sees_every_key(isa):
    q, k, v = _qkv(1, 9, 3, 50, 130, 64, seed=9)
    want, bound = _reference(q, _f64(k), _f64(v), 0.5, np.ones((50, 130), bool))
    _check(ext.prefill_attention(q, [k], [v], 0.5), want, bound)


@needs_ext
def test_float16_keys_and_values(isa):
    q, k, v = _qkv(1, 9, 3, 300, 400, 64, seed=4, dtype=mx.float16)
    want, bound = _reference(q, _f64(k), _f64(v), 0.5, _causal(300, 400))
    got = ext.prefill_attention(q, [k], [v], 0.5, None, True)
    _check(got, want, bound)
    # float16 is widened exactly as it is read: the bits of a float32 call on the same values
    same = ext.prefill_attention(q, [k.astype(mx.float32)], [v.astype(mx.float32)], 0.5, None, True)
    np.testing.assert_array_equal(np.array(got), np.array(same))


def _quantized(b, h, s, d, *, bits, group, seed):
    mx.random.seed(seed)
    n = (s + 255) // 256 * 256  # a cache's buffer, a whole number of steps
    w, sc, bi = mx.quantize(mx.random.normal((b, h, n, d)), group_size=group, bits=bits)
    return tuple(x[:, :, :s, :] for x in (w, sc, bi))


class QuantizedCache:
    """What mlx-lm's attention looks at on a quantized cache."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size


@needs_ext
@pytest.mark.parametrize(("bits", "group"), [(8, 64), (4, 32), (4, 64), (8, 32)])
@pytest.mark.parametrize(("n", "s"), [(30, 30), (300, 700)])
def test_quantized_cache_matches_dequantized_and_mlx_lm(isa, bits, group, n, s):
    mx.random.seed(n)
    q = mx.random.normal((1, n, 9, 64)).transpose(0, 2, 1, 3)
    k = _quantized(1, 3, s, 64, bits=bits, group=group, seed=s)
    v = _quantized(1, 3, s, 64, bits=bits, group=group, seed=s + 1)
    kd = np.array(mx.dequantize(*k, group_size=group, bits=bits), dtype=np.float64)
    vd = np.array(mx.dequantize(*v, group_size=group, bits=bits), dtype=np.float64)
    want, bound = _reference(q, kd, vd, 0.5, _causal(n, s))
    got = ext.prefill_attention(q, list(k), list(v), 0.5, None, True, 0, group, bits)
    _check(got, want, bound)
    # (a copy: mlx-lm's function scales its queries in place, ``queries *= scale``)
    ref = quantized_scaled_dot_product_attention(mx.array(q), k, v, scale=0.5, mask="causal",
                                                 group_size=group, bits=bits)
    _check(got, np.array(ref, dtype=np.float64), 2 * bound)
    # and through the wrapper mlx-lm's models call
    wrapped = _attention.scaled_dot_product_attention(q, k, v, cache=QuantizedCache(bits, group),
                                                      scale=0.5, mask="causal")
    np.testing.assert_array_equal(np.array(wrapped), np.array(got))


@needs_ext
def test_every_path_agrees_with_the_portable_one():
    """The SIMD paths compute the portable loops' sums in other orders only."""
    q, k, v = _qkv(1, 9, 3, 500, 800, 64, seed=11)
    before = ext.isa()
    outs = {}
    try:
        for name in ISAS:
            ext.set_isa(name)
            outs[name] = np.array(ext.prefill_attention(q, [k], [v], 0.5, None, True), dtype=np.float64)
    finally:
        ext.set_isa(before)
    _, bound = _reference(q, _f64(k), _f64(v), 0.5, _causal(500, 800))
    for name, out in outs.items():
        assert np.max(np.abs(out - outs[ISAS[0]])) <= 2 * bound, name


@needs_ext
def test_refuses_what_it_does_not_compute():
    q, k, v = _qkv(1, 4, 2, 20, 20, 16, seed=1)
    with pytest.raises(ValueError, match="multiple"):
        ext.prefill_attention(q, [mx.concatenate([k, k[:, :1]], axis=1)],
                              [mx.concatenate([v, v[:, :1]], axis=1)], 1.0)
    with pytest.raises(ValueError, match="float32"):
        ext.prefill_attention(q.astype(mx.float16), [k], [v], 1.0)
    with pytest.raises(ValueError, match="bool or float32"):
        ext.prefill_attention(q, [k], [v], 1.0, mx.ones((20,), dtype=mx.int32))
    with pytest.raises(ValueError):
        ext.prefill_attention(q, [k], [v], 1.0, mx.ones((7,), dtype=mx.bool_))  # does not broadcast
    with pytest.raises(ValueError, match="head size"):
        ext.prefill_attention(q, [k[..., :8]], [v], 1.0)
    with pytest.raises(ValueError, match="bits"):
        ext.prefill_attention(q, [k], [v], 1.0, None, True, 0, 64, 3)
    with pytest.raises(ValueError, match="share a dtype"):
        ext.prefill_attention(q, [k], [v.astype(mx.float16)], 1.0)


@needs_ext
def test_wrapper_routes_prompts_to_the_kernel(monkeypatch):
    calls = []
    real = ext.prefill_attention

    class Spy:
        def __getattr__(self, name):
            return getattr(ext, name)

        def prefill_attention(self, *a):
            calls.append(a)
            return real(*a)

    monkeypatch.setattr(_qmatmul, "_ext", Spy())
    sdpa = _attention.scaled_dot_product_attention
    q, k, v = _qkv(1, 4, 2, 40, 60, 16, seed=2)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal")
    got = sdpa(q, k, v, cache=None, scale=0.5, mask="causal")
    assert len(calls) == 1 and calls[0][5] is True
    np.testing.assert_allclose(np.array(got), np.array(ref), atol=1e-5)
    sdpa(q[:, :, :16], k, v, cache=None, scale=0.5, mask="causal")  # 16 positions: the decode kernel
    sdpa(q, k, v, cache=None, scale=0.5, mask="causal", sinks=mx.zeros((4,)))  # sinks: mlx-lm's
    sdpa(q.astype(mx.bfloat16), k.astype(mx.bfloat16), v.astype(mx.bfloat16),
         cache=None, scale=0.5, mask=None)
    assert len(calls) == 1
    monkeypatch.setenv(_attention.NO_PREFILL_ATTENTION_ENV, "1")
    sdpa(q, k, v, cache=None, scale=0.5, mask="causal")
    assert len(calls) == 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random model with heads of 32 (a quantized cache's smallest group)."""
    from afm_core.testing import make_random_model

    return make_random_model(tmp_path_factory.mktemp("heads32"), hidden_size=128, num_heads=4,
                             num_kv_heads=2)


@needs_ext
@pytest.mark.parametrize("kv_bits", [None, 8])
def test_model_prefill_through_the_kernel(isa, model_dir, monkeypatch, kv_bits):
    """A real (tiny, random) model prefilled in chunks through the kernel and
    through MLX's graph: the same next-token logits to float32 rounding (the
    layer-level bound above, carried through two layers and the head) and the
    same greedy continuation."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from afm_core._mlx.fusion import fuse_for_cpu, unfuse_cpu_kernels
    from afm_core._mlx.quantized_cache import make_quantized_cache

    model = mlx_lm.load(str(model_dir))[0]
    fuse_for_cpu(model)
    prompt = [(i * 37 + 11) % 1000 + 3 for i in range(600)]

    def run() -> tuple[np.ndarray, list[int]]:
        cache = (make_prompt_cache(model) if kv_bits is None
                 else make_quantized_cache(model, bits=kv_bits, group_size=32))
        for s in range(0, len(prompt) - 1, 256):
            model(mx.array(prompt[s:min(s + 256, len(prompt) - 1)])[None], cache=cache)
        logits = model(mx.array(prompt[-1:])[None], cache=cache)[0, -1]
        tokens = [int(mx.argmax(logits))]
        for _ in range(8):
            tokens.append(int(mx.argmax(model(mx.array(tokens[-1:])[None], cache=cache)[0, -1])))
        return np.array(logits, dtype=np.float64), tokens

    try:
        kernel_logits, kernel_tokens = run()
        monkeypatch.setenv(_attention.NO_PREFILL_ATTENTION_ENV, "1")
        mlx_logits, mlx_tokens = run()
    finally:
        unfuse_cpu_kernels(model)  # (gives the module-wide names back)
    assert np.max(np.abs(kernel_logits - mlx_logits)) <= 1e-4 * np.max(np.abs(mlx_logits))
    assert kernel_tokens == mlx_tokens


@needs_ext
@pytest.mark.skipif(not _attention._prefill_enabled(), reason="the prefill kernel is switched off")
def test_training_takes_mlx_lm_attention_inside_mlx_lm_operations():
    """The prefill kernel has no gradient: a model trained in a process where a
    served model rebound mlx-lm's attention does it inside mlx_lm_operations()."""
    from mlx_lm.models.base import scaled_dot_product_attention as mlx_attention

    from afm_core._mlx.reference_ops import mlx_lm_operations

    mx.random.seed(3)
    q, k, v = (mx.random.normal((1, 2, 40, 64)) for _ in range(3))

    def loss(attend: Any) -> Any:
        return lambda q: attend(q, k, v, cache=None, scale=0.125, mask="causal").sum()

    with pytest.raises(ValueError, match="vjp"):  # outside: the kernel, which cannot be differentiated
        mx.eval(mx.grad(loss(_attention.scaled_dot_product_attention))(q))
    with mlx_lm_operations():
        got = mx.grad(loss(_attention.scaled_dot_product_attention))(q)
    want = mx.grad(loss(mlx_attention))(q)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
