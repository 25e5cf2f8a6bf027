"""The sgemm path's dequantized tiles: every kernel set's own dequantization
(AVX2's vectorized one, the generic loop) gives the same float32 values
(``fma(scale, code, bias)``, rounded once), so a prompt's product has the
same bits whichever set the CPU runs; and the values are the layout's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import qmatmul as _qmatmul

ext = _qmatmul._ext
pytestmark = pytest.mark.skipif(
    ext is None or not ext.has_sgemm(),
    reason="afm_core._mlx.qmm_ext is not built (or disabled), or no cblas_sgemm is bound")

ISAS = ext.available_isas() if ext is not None else []
ROWS = 96  # above every kernel set's default gemm_rows: the sgemm path


@pytest.fixture
def sgemm_from_64():
    ext.set_gemm_rows(64)
    yield
    ext.set_gemm_rows(-1)
    ext.set_isa(ISAS[-1])


def _weight(n, k, bits, group, dtype, symmetric):
    w = mx.random.normal((n, k), key=mx.random.key(bits * 1000 + group)) * 0.05
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    s = s.astype(dtype)
    if symmetric:
        return q, s, mx.array(-(1 << (bits - 1)), dtype=dtype)
    return q, s, b.astype(dtype)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("symmetric", [False, True], ids=["biases", "factor"])
def test_every_kernel_set_dequantizes_to_the_same_bits(sgemm_from_64, bits, group, dtype, symmetric):
    k = 640
    q, s, b = _weight(200, k, bits, group, dtype, symmetric)  # 200 rows: tiles split over the pool
    x = mx.random.normal((ROWS, k), key=mx.random.key(7))
    outs = {}
    for isa in ISAS:
        ext.set_isa(isa)
        outs[isa] = ext.quantized_matmul(x, q, s, b, group, bits)
        mx.eval(outs[isa])
    first = outs[ISAS[0]]
    assert all(mx.array_equal(first, o).item() for o in outs.values()), list(outs)


@pytest.mark.parametrize("bits", [3, 4, 5, 6, 8])
def test_the_tiles_hold_the_layouts_values(sgemm_from_64, bits):
    k, n = 256, 64
    q, s, b = _weight(n, k, bits, 32, mx.float16, False)
    x = mx.eye(k)[:ROWS]  # rows of the identity: the product is the dequantized weight's columns
    got = np.array(ext.quantized_matmul(x, q, s, b, 32, bits))
    ones = mx.ones(s.shape, dtype=mx.float32)
    codes = np.array(mx.dequantize(q, ones, mx.zeros_like(ones), group_size=32, bits=bits), dtype=np.float64)
    s64 = np.repeat(np.array(s.astype(mx.float32), dtype=np.float64), 32, axis=1)
    b64 = np.repeat(np.array(b.astype(mx.float32), dtype=np.float64), 32, axis=1)
    exact = (s64 * codes + b64).astype(np.float32)  # rounded once, as fma
    np.testing.assert_array_equal(got, exact.T[:ROWS])
