"""afm_core._mlx.qmm_ext against MLX's quantized and dequantized products.

Tolerances:

* The integer path (fewer than ``AFM_QMM_GEMM_ROWS`` rows) rounds each
  activation to int8 per block of 32 (x ~= d * q, |x - d * q| <= d / 2, d =
  max |x| / 127 of the block) and computes everything else exactly or in
  float32.  So the error of an output is at most ``sum_i |w_i| * d_i / 2``
  (``w_i`` the weights dequantized without their group's bias, since the
  bias term uses the exact sum of x); the tests assert that bound, computed in float64
  with 1% and a float32 rounding of slack, instead of a fixed tolerance.  For
  Gaussian data it comes to about 1% of the largest output.
* Activations that are exactly on the int8 grid of their block make the
  integer path exact up to float32 rounding: 1e-5 of the largest output.
* The sgemm path (many rows) dequantizes in float32: 1e-4 of the largest output.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import qmatmul as _qmatmul

ext = _qmatmul._ext
needs_ext = pytest.mark.skipif(
    ext is None, reason="afm_core._mlx.qmm_ext is not built (or AFM_NO_QMM / AFM_NO_EXTENSIONS is set)")

ISAS = ext.available_isas() if ext is not None else []


@pytest.fixture
def isa(request):
    best = ISAS[-1]
    ext.set_isa(request.param)
    yield request.param
    ext.set_isa(best)


@pytest.fixture
def integer_path():
    ext.set_gemm_rows(0)  # never sgemm
    yield
    ext.set_gemm_rows(32)


def _weights(n, k, bits, group, scale_dtype=mx.float32, seed=0):
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return q, s.astype(scale_dtype), b.astype(scale_dtype)


def _int8_bound(x, q, s, b, group, bits):
    """Largest error int8 activations can cause, per output (float64): the
    bias term uses the exact sums of x, so only ``scale * q`` meets the
    rounded activations."""
    wd = np.array(mx.dequantize(q, s, b, group_size=group, bits=bits).astype(mx.float32),
                  dtype=np.float64)
    wd = wd - np.repeat(np.array(b.astype(mx.float32), dtype=np.float64), group, axis=1)
    xn = np.array(x, dtype=np.float64).reshape(-1, x.shape[-1])
    m, k = xn.shape
    d = np.abs(xn.reshape(m, k // 32, 32)).max(axis=2) / 127.0  # (m, blocks)
    half = np.repeat(d, 32, axis=1) / 2  # (m, k)
    return half @ np.abs(wd).T  # (m, n)


def _reference(x, q, s, b, group, bits):
    wd = mx.dequantize(q, s, b, group_size=group, bits=bits).astype(mx.float32)
    return np.array(x.astype(mx.float32) @ wd.T, dtype=np.float64)


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("shape", [(96, 64), (200, 576), (33, 320)])
def test_integer_path_within_int8_bound(isa, integer_path, bits, group, rows, shape):
    n, k = shape
    q, s, b = _weights(n, k, bits, group)
    x = mx.random.normal((rows, k), key=mx.random.key(rows))
    y = np.array(ext.quantized_matmul(x, q, s, b, group, bits), dtype=np.float64)
    ref = _reference(x, q, s, b, group, bits)
    bound = _int8_bound(x, q, s, b, group, bits)
    slack = 1e-5 * np.abs(ref).max()
    assert np.all(np.abs(y - ref) <= 1.01 * bound + slack)
    # and agrees with MLX's own quantized product within the same bound
    mlx_q = np.array(mx.quantized_matmul(x, q, s, b, group_size=group, bits=bits))
    assert np.all(np.abs(y - mlx_q) <= 1.01 * bound + 2 * slack)


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_integer_path_exact_on_the_int8_grid(isa, integer_path, bits, group):
    rng = np.random.default_rng(group + bits)
    m, k, n = 9, 640, 72
    d = rng.uniform(0.01, 0.1, size=(m, k // 32, 1))
    qi = rng.integers(-127, 128, size=(m, k // 32, 32))
    qi[:, :, 3] = 127  # each block's maximum is on the grid
    x = mx.array((qi * d).reshape(m, k).astype(np.float32))
    q, s, b = _weights(n, k, bits, group)
    y = np.array(ext.quantized_matmul(x, q, s, b, group, bits), dtype=np.float64)
    ref = _reference(x, q, s, b, group, bits)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("act_bits", [16, 8])
@pytest.mark.parametrize(("bits", "group", "shape"),
                         [(4, 32, (130, 576)), (8, 64, (72, 320)), (4, 128, (40, 640))])
def test_a_row_gives_the_same_bits_among_any_number_of_rows(isa, integer_path, act_bits, bits,
                                                             group, shape):
    """Speculative decoding's verify pass (several rows) must give each row the
    bits its one-row decode step gives: within one kernel set a row's output
    may not depend on the other rows or on how they were blocked."""
    n, k = shape
    q, s, b = _weights(n, k, bits, group)
    x = mx.random.normal((17, k), key=mx.random.key(k + bits))
    ext.set_activation_bits(act_bits)
    try:
        alone = [np.array(ext.quantized_matmul(x[i:i + 1], q, s, b, group, bits))
                 for i in range(17)]
        for rows in range(1, 18, 2):
            y = np.array(ext.quantized_matmul(x[:rows], q, s, b, group, bits))
            for i in range(rows):
                assert np.array_equal(y[i:i + 1], alone[i]), (rows, i)
    finally:
        ext.set_activation_bits(16)


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("rows", [64, 300])
def test_sgemm_path_is_float_precise(bits, group, rows):
    if not ext.has_sgemm():
        pytest.skip("no cblas_sgemm in the process")
    q, s, b = _weights(130, 192, bits, group)
    x = mx.random.normal((rows, 192))
    y = np.array(ext.quantized_matmul(x, q, s, b, group, bits), dtype=np.float64)
    ref = _reference(x, q, s, b, group, bits)
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()


@needs_ext
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_half_precision_scales(scale_dtype, rows):
    q, s, b = _weights(96, 256, 4, 32, scale_dtype)
    x = mx.random.normal((rows, 256))
    y = np.array(ext.quantized_matmul(x, q, s, b, 32, 4), dtype=np.float64)
    ref = _reference(x, q, s, b, 32, 4)  # dequantize reads the same half scales
    bound = _int8_bound(x, q, s, b, 32, 4)
    assert np.all(np.abs(y - ref) <= 1.01 * bound + 1e-4 * np.abs(ref).max())


@needs_ext
def test_batched_strided_and_half_activations():
    q, s, b = _weights(64, 128, 4, 32)
    x = mx.random.normal((3, 5, 128))
    ref = _reference(x, q, s, b, 32, 4).reshape(3, 5, 64)
    y = ext.quantized_matmul(x, q, s, b, 32, 4)
    assert y.shape == (3, 5, 64)
    bound = _int8_bound(x, q, s, b, 32, 4).reshape(3, 5, 64)
    assert np.all(np.abs(np.array(y) - ref) <= 1.01 * bound + 1e-5)
    xt = mx.random.normal((128, 4)).T  # not row-contiguous
    yt = np.array(ext.quantized_matmul(xt, q, s, b, 32, 4))
    assert np.all(np.abs(yt - _reference(xt, q, s, b, 32, 4))
                  <= 1.01 * _int8_bound(xt, q, s, b, 32, 4) + 1e-5)
    xh = x.astype(mx.float16)
    yh = ext.quantized_matmul(xh, q, s, b, 32, 4)
    assert yh.dtype == mx.float16
    assert np.abs(np.array(yh.astype(mx.float32)) - ref).max() <= 0.05 * np.abs(ref).max()


@needs_ext
def test_rejects_layouts_it_does_not_cover():
    q, s, b = _weights(64, 128, 4, 32)
    with pytest.raises(ValueError):
        ext.quantized_matmul(mx.zeros((1, 128)), q, s, b, 32, 3)
    with pytest.raises(ValueError):
        ext.quantized_matmul(mx.zeros((1, 100)), q, s, b, 32, 4)


def test_fallback_is_mlx_quantized_matmul(monkeypatch):
    q, s, b = _weights(64, 128, 4, 32)
    x = mx.random.normal((3, 128))
    monkeypatch.setattr(_qmatmul, "_ext", None)
    y = _qmatmul.quantized_matmul(x, q, s, b, group_size=32, bits=4)
    ref = mx.quantized_matmul(x, q, s, b, group_size=32, bits=4)
    assert mx.array_equal(y, ref)
    assert not _qmatmul.qmm_available()


def test_the_compiled_kernels_load_by_default():
    import importlib.util
    import os
    import sys

    built = importlib.util.find_spec("afm_core._mlx.qmm_ext") is not None
    disabled = any(os.environ.get(v, "") not in ("", "0")
                   for v in ("AFM_NO_QMM", "AFM_NO_EXTENSIONS"))
    if disabled:
        pytest.skip("afm_core._mlx.qmm_ext is disabled")
    # on Linux (where CI runs) a missing build is a failure, never a silent skip
    assert built or not sys.platform.startswith("linux"), "afm_core._mlx.qmm_ext was not built"
    if not built:
        pytest.skip("afm_core._mlx.qmm_ext is not built")
    assert _qmatmul.qmm_available()
    assert _qmatmul.kernel_isa() in ext.available_isas()


def _greedy(model, prompt, steps):
    ids = list(prompt)
    for _ in range(steps):
        logits = model(mx.array([ids]))[0, -1]
        ids.append(int(mx.argmax(logits)))
    return ids[len(prompt):]


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
def test_model_greedy_tokens_match_mlx_lm(tmp_path, bits):
    from mlx_lm.utils import load_model

    from afm_core._mlx.fusion import fuse_cpu_kernels, unfuse_cpu_kernels
    from afm_core.testing import make_random_model

    path = make_random_model(tmp_path / "m", hidden_size=128, num_layers=2,
                             intermediate_size=256, seed=3)
    model, _ = load_model(path)
    nn.quantize(model, group_size=32, bits=bits)  # the output head is a tied QuantizedEmbedding
    mx.eval(model.parameters())
    prompt = [5, 17, 256, 3, 99, 42, 7]
    expected = _greedy(model, prompt, 12)
    logits_ref = model(mx.array([prompt]))
    classes = [type(m) for _, m in model.named_modules()]

    swapped = fuse_cpu_kernels(model, transpose=False)
    assert swapped >= 2 * 7 + 1  # every projection of 2 layers, and the head
    assert any(type(m).__name__ == "_FastQuantizedEmbedding" for _, m in model.named_modules())
    logits = model(mx.array([prompt]))
    assert np.abs(np.array(logits - logits_ref)).max() <= 0.05 * np.abs(np.array(logits_ref)).max()
    assert _greedy(model, prompt, 12) == expected

    unfuse_cpu_kernels(model)
    assert [type(m) for _, m in model.named_modules()] == classes
    assert _greedy(model, prompt, 12) == expected
