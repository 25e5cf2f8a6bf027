"""The one-operation norm and rotary embedding (``ext/qmm/layer_ops.cpp``)
against mlx's own layers, and the fused layers that use them.  The rotary
embedding of L positions gives, at position l, the bits of a one-position
call at offset + l (what a speculative verify step needs, and what makes a
prompt's keys the ones its decode steps would have written).

Both compute what mlx computes in another summation order (the norm's sum of
squares) or with libm's sin/cos, so they agree to float32 rounding: 4e-6 of
the largest output here.
"""

from __future__ import annotations

import math
import re
import tempfile

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import fusion
from afm_core._mlx import qmatmul as _qmatmul

ext = _qmatmul.extension()
needs_ext = pytest.mark.skipif(ext is None, reason="afm_core._mlx.qmm_ext is not built or disabled")
TOL = 4e-6


def _close(got, ref):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert float(mx.max(mx.abs(got - ref))) <= TOL * max(1.0, float(mx.max(mx.abs(ref))))


def _freqs(dims, head_dim, traditional, base=10000.0, scale=1.0):
    half = dims // 2
    f = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))
    f = mx.repeat(f, 2) if traditional else mx.concatenate([f, f])
    return mx.concatenate([f, mx.zeros((head_dim - dims,), dtype=mx.float32)]) * scale


@needs_ext
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 7, 64), (5, 13), (3, 1, 1, 100)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_matches_mlx(shape, eps):
    mx.random.seed(len(shape) + shape[-1])
    x = mx.random.normal(shape) * 4
    w = mx.random.normal((shape[-1],))
    _close(ext.rms_norm(x, w, eps), mx.fast.rms_norm(x, w, eps))


@needs_ext
def test_rms_norm_reads_strided_input():
    x = mx.random.normal((4, 6, 24)).transpose(1, 0, 2)[:, ::2, :]
    w = mx.random.normal((24,))[::-1]
    _close(ext.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5))
    xs = mx.random.normal((24, 5)).T  # last axis not contiguous
    _close(ext.rms_norm(xs, w, 1e-5), mx.fast.rms_norm(xs, w, 1e-5))


@needs_ext
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(("dims", "head_dim"), [(64, 64), (32, 64), (128, 128)])
@pytest.mark.parametrize("offset_dtype", [mx.int32, mx.int64, mx.uint32, mx.float32])
def test_rope_decode_matches_mlx_rope(traditional, dims, head_dim, offset_dtype):
    rope = nn.RoPE(dims, traditional=traditional, base=10000.0, scale=0.5)
    mx.random.seed(dims)
    x = mx.random.normal((3, 1, 5, head_dim)).transpose(0, 2, 1, 3)  # as a model makes it
    positions = [0, 37, 4099]
    ref = mx.concatenate([rope(x[i:i + 1], offset=p) for i, p in enumerate(positions)])
    freqs = _freqs(dims, head_dim, traditional, scale=0.5)
    got = ext.rope_decode(x, mx.array(positions, dtype=offset_dtype), freqs, dims, traditional)
    _close(got, ref)
    one = ext.rope_decode(x[:1], mx.array(37, dtype=offset_dtype), freqs, dims, traditional)
    _close(one, rope(x[:1], offset=37))


@needs_ext
@pytest.mark.parametrize("n", [1, 2, 3, 5, 9, 16, 300])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offset_dtype", [mx.int32, mx.int64, mx.uint32, mx.float32])
def test_rope_of_positions_is_one_position_calls_and_mlx(n, traditional, offset_dtype):
    dims, head_dim = 48, 64
    rope = nn.RoPE(dims, traditional=traditional, base=10000.0)
    freqs = _freqs(dims, head_dim, traditional)
    mx.random.seed(n)
    x = mx.random.normal((3, n, 5, head_dim)).transpose(0, 2, 1, 3)  # as a model makes it
    positions = [0, 37, 4099]
    got = ext.rope_decode(x, mx.array(positions, dtype=offset_dtype), freqs, dims, traditional)
    ref = mx.concatenate([rope(x[i:i + 1], offset=p) for i, p in enumerate(positions)])
    _close(got, ref)
    got = np.array(got)
    for j in range(n):
        at = mx.array([p + j for p in positions], dtype=offset_dtype)
        one = ext.rope_decode(x[:, :, j:j + 1], at, freqs, dims, traditional)
        np.testing.assert_array_equal(got[:, :, j:j + 1], np.array(one))
    scalar = ext.rope_decode(x[1:2], mx.array(37, dtype=offset_dtype), freqs, dims, traditional)
    np.testing.assert_array_equal(np.array(scalar), got[1:2])


@needs_ext
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offset", [37, "rows"])
def test_rope_pair_is_two_rope_calls(traditional, offset):
    """A layer's queries and keys in one operation: the bits of one call each,
    through ``_FusedRoPE.pair`` where both calls would take the kernel."""
    dims, head_dim = 48, 64
    freqs = _freqs(dims, head_dim, traditional)
    mx.random.seed(5)
    q = mx.random.normal((3, 1, 6, head_dim)).transpose(0, 2, 1, 3)
    k = mx.random.normal((3, 2, 1, head_dim))
    at = mx.array(offset, dtype=mx.int32) if isinstance(offset, int) else mx.array([0, 37, 4099])
    got = ext.rope_decode_pair(q, k, at, freqs, dims, traditional)
    for g, x in zip(got, (q, k), strict=True):
        np.testing.assert_array_equal(np.array(g), np.array(ext.rope_decode(x, at, freqs, dims, traditional)))
    layer = nn.RoPE(dims, traditional=traditional, base=10000.0)
    fusion.fuse_cpu_kernels(layer)
    pair = layer.pair(q, k, offset if isinstance(offset, int) else at)
    assert pair is not None
    for g, x in zip(pair, (q, k), strict=True):
        np.testing.assert_array_equal(np.array(g), np.array(layer(x, offset if isinstance(offset, int) else at)))
    assert layer.pair(q.astype(mx.float16), k.astype(mx.float16), at) is None  # (not the kernel's)
    assert layer.pair(q, k[:, :, :, :32], at) is None
    with pytest.raises(ValueError, match="offset"):
        ext.rope_decode_pair(q, k, mx.array([1, 2]), freqs, dims, traditional)


@needs_ext
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offset", [37, "rows"])
@pytest.mark.parametrize("prologue", [False, True])
def test_rope_in_the_product_epilogue_is_rope_pair(traditional, offset, prologue):
    """A q/k/v family's product with the rotary embedding of its first two
    outputs in its epilogue (``quantized_matmul_split``'s ``rope_*``): the
    bits of the product, then ``rope_decode_pair`` of its queries and keys;
    the values and biases as without it; with the norm in the prologue too."""
    rows, heads, kv_heads, head_dim, dims, k_dim = 3, 6, 2, 64, 48, 256
    freqs = _freqs(dims, head_dim, traditional)
    mx.random.seed(11)
    splits = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    w, scales, biases = mx.quantize(mx.random.normal((sum(splits), k_dim)) * 0.05, group_size=32, bits=4)
    x = mx.random.normal((rows, 1, k_dim))
    bias = [mx.random.normal((n,)) for n in splits]  # (qwen2's q/k/v biases)
    norm = (mx.random.normal((k_dim,)) + 1.0, 1e-6) if prologue else (None, 0.0)
    shapes = [[rows, h, 1, head_dim] for h in (heads, kv_heads, kv_heads)]
    at = mx.array(offset, dtype=mx.int32) if isinstance(offset, int) else mx.array([0, 37, 4099])
    mx.eval(w, scales, biases, x, bias, freqs, at, *norm[:1])
    plain = ext.quantized_matmul_split(x, w, scales, biases, 32, 4, splits, bias, *norm, shapes)
    got = ext.quantized_matmul_split(x, w, scales, biases, 32, 4, splits, bias, *norm, shapes,
                                     at, freqs, dims, traditional, 2)
    want = [*ext.rope_decode_pair(plain[0], plain[1], at, freqs, dims, traditional), plain[2]]
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *got)
        operations = re.findall(r'label ?= ?"([A-Za-z][^"]*)", shape=rectangle', f.read())
    assert operations == ["AfmQuantizedMatmul"]  # one operation
    for g, r in zip(got, want, strict=True):
        assert g.shape == r.shape
        np.testing.assert_array_equal(np.array(g), np.array(r))
    with pytest.raises(ValueError, match="rotary"):  # the outputs must be heads
        ext.quantized_matmul_split(x, w, scales, biases, 32, 4, splits, bias, *norm, [],
                                   at, freqs, dims, traditional, 2)
    with pytest.raises(ValueError, match="rotary"):
        ext.quantized_matmul_split(x, w, scales, biases, 32, 4, splits, bias, *norm, shapes,
                                   mx.array([1, 2]), freqs, dims, traditional, 2)
    with pytest.raises(ValueError, match="rotary"):
        ext.quantized_matmul_split(x, w, scales, biases, 32, 4, splits, bias, *norm, shapes,
                                   at, freqs, 7, traditional, 2)


@needs_ext
def test_refusals():
    x = mx.zeros((1, 2, 1, 8))
    f = mx.zeros((8,))
    with pytest.raises(ValueError, match="float32"):
        ext.rms_norm(x.astype(mx.float16), mx.ones((8,)), 1e-5)
    with pytest.raises(ValueError):
        ext.rms_norm(x, mx.ones((7,)), 1e-5)
    with pytest.raises(ValueError, match=r"\(B, H, L, D\)"):
        ext.rope_decode(mx.zeros((2, 3, 8)), mx.array(0), f, 8, False)
    with pytest.raises(ValueError, match="offset"):
        ext.rope_decode(x, mx.array([1, 2]), f, 8, False)
    with pytest.raises(ValueError, match="dims"):
        ext.rope_decode(x, mx.array(1), f, 7, False)


@needs_ext
@pytest.mark.parametrize("ops", ["on", "off"])
def test_fused_layers_use_them_and_match_mlx_layers(ops, monkeypatch):
    if ops == "off":
        monkeypatch.setenv(fusion.NO_LAYER_OPS_ENV, "1")
    norm, rope = nn.RMSNorm(64, eps=1e-5), nn.RoPE(32, traditional=False, base=500000.0)
    ref_layer = nn.RoPE(32, traditional=False, base=500000.0)
    norm.weight = mx.random.normal((64,))
    model = nn.Sequential(norm, rope)
    x = mx.random.normal((2, 1, 64))
    q = mx.random.normal((2, 1, 4, 64)).transpose(0, 2, 1, 3)
    offsets = mx.array([3, 90], dtype=mx.int32)
    ref_norm = norm(x)
    ref_rope = mx.concatenate([rope(q[i:i + 1], offset=int(offsets[i])) for i in range(2)])
    assert fusion.fuse_cpu_kernels(model, transpose=False) == 2
    seen = []

    def census(out):
        import tempfile
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
            mx.export_to_dot(f.name, out)
            seen.append(f.read())
        return out

    _close(census(norm(x)), ref_norm)
    _close(census(rope(q, offset=offsets)), ref_rope)
    one_op = ("AfmRMSNorm" in seen[0], "AfmRopeDecode" in seen[1])
    assert one_op == ((True, True) if ops == "on" else (False, False))
    # a verify step: three positions per row, at an int offset (mlx-lm's
    # single-sequence cache) or an array of them (its batch cache)
    q3 = mx.random.normal((2, 3, 4, 64)).transpose(0, 2, 1, 3)
    _close(census(rope(q3, offset=7)), ref_layer(q3, offset=7))
    _close(census(rope(q3, offset=offsets)),
           mx.concatenate([ref_layer(q3[i:i + 1], offset=int(offsets[i])) for i in range(2)]))
    # a prompt's chunk, at an int offset and at the batch cache's array
    q40 = mx.random.normal((2, 40, 4, 64)).transpose(0, 2, 1, 3)
    _close(census(rope(q40, offset=7)), ref_layer(q40, offset=7))
    _close(census(rope(q40, offset=offsets)),
           mx.concatenate([ref_layer(q40[i:i + 1], offset=int(offsets[i])) for i in range(2)]))
    assert [("AfmRopeDecode" in g) for g in seen[2:]] == [ops == "on"] * 4
    fusion.unfuse_cpu_kernels(model)
    np.testing.assert_allclose(np.array(norm(x)), np.array(ref_norm), rtol=0, atol=0)
