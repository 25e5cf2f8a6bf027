"""Products with GGUF's K-quant blocks as they are (Q4_K, Q6_K; ``group_size``
256 in ``qmm_ext``'s products, ``ext/qmm/kquant_kernels.h``).

The blocks are random bytes (every byte pattern is a valid block once its
float16 scales are finite), their values ``gguf.quants.dequantize``'s (the
gguf package's own reading of llama.cpp's format).  The sgemm path's
dequantization must give exactly those values; the integer kernels' error is
bounded by the activations' int8 rounding per 256 values, derived below from
the arithmetic; every kernel set gives what the scalar one does up to float
summation order, and a row's output never depends on the other rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import qmatmul as _qmatmul

gguf = pytest.importorskip("gguf")

ext = _qmatmul._ext
pytestmark = pytest.mark.skipif(
    ext is None, reason="afm_core._mlx.qmm_ext is not built (or AFM_NO_QMM / AFM_NO_EXTENSIONS is set)")

ISAS = ext.available_isas() if ext is not None else []
BLOCK_BYTES = {4: 144, 6: 210}
GGML_TYPE = {4: "Q4_K", 6: "Q6_K"}
ZERO = mx.array(0.0)


def random_blocks(kind: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of k values of K-quant type ``kind`` (4: Q4_K, 6: Q6_K): random
    codes, scales and mins, float16 super-scales of a trained weight's size."""
    rng = np.random.default_rng(seed)
    nb, size = k // 256, BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)

    def halves(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, size=(n, nb)).astype(np.float16)[..., None].view(np.uint8)

    if kind == 4:
        raw[:, :, 0:2] = halves(2e-4, 2e-3)  # d
        raw[:, :, 2:4] = halves(1e-4, 1e-3)  # dmin
    else:
        raw[:, :, 208:210] = halves(1e-5, 2e-4)  # d
    return raw.reshape(n, nb * size)


def dequantized(kind: int, raw: np.ndarray) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, GGML_TYPE[kind])),
                      dtype=np.float32)


def product(x: np.ndarray, raw: np.ndarray, kind: int) -> np.ndarray:
    return np.array(ext.quantized_matmul(mx.array(x), mx.array(raw), ZERO, ZERO, 256, kind))


def int8_bound(x: np.ndarray, w: np.ndarray, passes: int) -> np.ndarray:
    """The most the int8 activations can move each output: value i of x is off
    by at most half its block's step (max |x| over its 256 / 127; a second
    pass quantizes that remainder again, its step at most the first's / 254),
    times |w_i|; plus float32 rounding of the sums (2^-20 of the terms' size)."""
    rows, k = x.shape
    amax = np.abs(x).reshape(rows, k // 256, 256).max(axis=2)
    step = amax / 127.0 if passes == 1 else amax / 127.0 / 254.0
    err = np.repeat(step / 2.0, 256, axis=1)  # (rows, k)
    magnitude = np.abs(x) @ np.abs(w).T
    return err @ np.abs(w).T * (1 + 1e-3) + magnitude * 2.0**-20


@pytest.fixture
def act_bits(request):
    ext.set_kquant_activation_bits(request.param)
    yield request.param
    ext.set_kquant_activation_bits(8)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("kind", [4, 6])
def test_the_sgemm_path_multiplies_exactly_ggufs_values(isa, kind):
    """One-hot rows through the sgemm path (from gemm_rows rows) give each
    weight value alone: exactly gguf's dequantization."""
    k, n = 512, 24
    raw = random_blocks(kind, n, k, seed=kind)
    assert ext.gemm_rows() <= k
    y = product(np.eye(k, dtype=np.float32), raw, kind)  # y[i, j] = w[j, i]
    np.testing.assert_array_equal(y.T, dequantized(kind, raw))


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("act_bits", [16, 8], indirect=True)
@pytest.mark.parametrize("kind", [4, 6])
def test_the_integer_kernels_are_within_the_activations_rounding(isa, act_bits, kind):
    k, n = 768, 40
    raw = random_blocks(kind, n, k, seed=10 + kind)
    w = dequantized(kind, raw).astype(np.float64)
    rng = np.random.default_rng(3)
    for rows in (1, 2, 3, 5, 9):  # the kernels take 1-4 quantized rows at a time
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x[:, 5] *= 40.0  # an outlier: its block's step is coarse, the bound says how coarse
        want = x.astype(np.float64) @ w.T
        got = product(x, raw, kind)
        bound = int8_bound(x.astype(np.float64), w, 1 if act_bits == 8 else 2)
        assert np.all(np.abs(got - want) <= bound), (rows, float(np.max(np.abs(got - want) / bound)))


@pytest.mark.parametrize("act_bits", [16, 8], indirect=True)
@pytest.mark.parametrize("kind", [4, 6])
def test_every_kernel_set_gives_the_scalar_products(act_bits, kind):
    k, n = 1024, 33
    raw = random_blocks(kind, n, k, seed=20 + kind)
    x = np.random.default_rng(4).standard_normal((6, k)).astype(np.float32)
    w = dequantized(kind, raw)
    magnitude = np.abs(x) @ np.abs(w).T
    before = ext.isa()
    try:
        assert ext.set_isa("scalar")
        scalar = product(x, raw, kind)
        for isa in ISAS:
            assert ext.set_isa(isa)
            # the same integer sums a block; only the float sums' order differs
            np.testing.assert_array_less(np.abs(product(x, raw, kind) - scalar), magnitude * 2.0**-18 + 1e-30)
    finally:
        ext.set_isa(before)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("act_bits", [16, 8], indirect=True)
@pytest.mark.parametrize("kind", [4, 6])
def test_a_rows_output_does_not_depend_on_the_other_rows(isa, act_bits, kind):
    """Speculation's verify pass must give one-row decoding's bits."""
    k, n = 512, 64
    raw = random_blocks(kind, n, k, seed=30 + kind)
    x = np.random.default_rng(5).standard_normal((7, k)).astype(np.float32)
    together = product(x, raw, kind)
    for i in range(len(x)):
        np.testing.assert_array_equal(product(x[i:i + 1], raw, kind)[0], together[i])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("kind", [4, 6])
def test_split_swiglu_and_residual_products_take_kquant_blocks(isa, kind):
    k = 512
    raw = random_blocks(kind, 96, k, seed=40 + kind)
    rng = np.random.default_rng(6)
    x = mx.array(rng.standard_normal((2, k)).astype(np.float32))
    whole = ext.quantized_matmul(x, mx.array(raw), ZERO, ZERO, 256, kind)
    bias = mx.array(rng.standard_normal(32).astype(np.float32))
    first, second = ext.quantized_matmul_split(x, mx.array(raw), ZERO, ZERO, 256, kind, [64, 32], [None, bias])
    assert mx.array_equal(first, whole[:, :64]).item()
    assert mx.array_equal(second, whole[:, 64:] + bias).item()
    swiglu = ext.quantized_matmul_swiglu(x, mx.array(raw), ZERO, ZERO, 256, kind)
    gate, up = whole[:, :48], whole[:, 48:]
    np.testing.assert_allclose(np.array(swiglu), np.array(gate * mx.sigmoid(gate) * up), rtol=1e-5, atol=1e-7)
    residual = mx.array(rng.standard_normal((2, 96)).astype(np.float32))
    with_residual = ext.quantized_matmul(x, mx.array(raw), ZERO, ZERO, 256, kind, None, residual)
    assert mx.array_equal(with_residual, whole + residual).item()


@pytest.mark.parametrize("kind", [4, 6])
def test_float16_and_bfloat16_inputs(kind):
    """x's rows as float32 (exact), the output rounded once to x's dtype."""
    raw = mx.array(random_blocks(kind, 16, 256, seed=50 + kind))
    x = mx.array(np.random.default_rng(7).standard_normal((1, 256)).astype(np.float32))
    for dtype in (mx.float16, mx.bfloat16):
        xs = x.astype(dtype)
        y = ext.quantized_matmul(xs, raw, ZERO, ZERO, 256, kind)
        assert y.dtype == dtype
        expect = ext.quantized_matmul(xs.astype(mx.float32), raw, ZERO, ZERO, 256, kind).astype(dtype)
        assert mx.array_equal(y, expect).item()


def test_bad_kquant_operands_get_clear_errors():
    raw = mx.array(random_blocks(4, 8, 512))
    x = mx.zeros((1, 512))
    cases = [
        ((x, raw, ZERO, ZERO, 256, 5), "bits 4 \\(Q4_K\\) or 6 \\(Q6_K\\)"),
        ((x, raw.view(mx.uint32), ZERO, ZERO, 256, 4), "uint8"),
        ((x, raw[:, :200], ZERO, ZERO, 256, 4), "whole blocks"),
        ((x, raw, mx.zeros((8, 2)), ZERO, 256, 4), "empty or 0-d"),
        ((mx.zeros((1, 256)), raw, ZERO, ZERO, 256, 4), "last dimension"),
        ((mx.zeros((1, 512), dtype=mx.int32), raw, ZERO, ZERO, 256, 4), "float32, float16 or bfloat16"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            ext.quantized_matmul(*args)


def test_prompts_of_some_tens_of_rows_stay_on_the_block_kernels():
    """Up to 96 rows (AFM_KQUANT_GEMM_ROWS) the int8 block kernels, not sgemm:
    their int8 rounding shows, where sgemm's float32 products are ~1e-7 off."""
    raw = random_blocks(4, 32, 512, seed=60)
    w = dequantized(4, raw).astype(np.float64)
    x = np.random.default_rng(8).standard_normal((64, 512)).astype(np.float32)
    want = x.astype(np.float64) @ w.T

    def error() -> float:
        return float(np.abs(product(x, raw, 4) - want).max() / np.abs(want).max())

    assert 1e-5 < error() < 2e-2
    ext.set_gemm_rows(32)  # an explicit setting applies to the blocks too
    try:
        assert error() < 1e-5
    finally:
        ext.set_gemm_rows(-1)
