"""afm_core._mlx.qmm_ext against MLX's quantized and dequantized products.

Every kernel set this CPU runs (``isa``), every bit width MLX's affine layout
has (2, 3, 4, 5, 6, 8), groups of 32, 64 and 128, float32, float16 and
bfloat16 scales, 1 to 17 rows, both activation precisions.  Tolerances come
from the arithmetic, not from one CPU:

* The integer path (fewer than ``AFM_QMM_GEMM_ROWS`` rows) rounds each
  activation per block of 32 and computes everything else exactly (integer
  sums) or in float32.  With 8-bit activations (x ~= d * q, d = max |x| / 127
  of the block) an activation is off by at most d / 2 = max|x| / 254.  With
  the default 16-bit precision it is off by at most max|x| / 64516: either an
  int8 pass plus an int8 pass over its remainder (the remainder is at most
  d / 2, so the second pass's step is at most max|x| / (254 * 127)), or one
  int16 rounding with step max|x| / 32512 (``avx512-vnni``).  The bias term
  uses the exact float sum of x, so only ``scale * q`` meets the rounded
  activations: the error of an output is at most ``sum_i |scale_i q_i| e_i``
  (``e_i`` the bound of activation i), asserted with 1% slack, plus the
  float32 rounding of the block sums, group sums and their accumulation:
  ``(K / 32 + 64) * 2**-24 * sum_i |x_i| (|scale_i q_i| + |bias_i|)``.
* Activations exactly on the int8 grid of their block make the integer path
  exact up to that float32 rounding, at either precision: an unpacking error
  in any single weight shows there.
* The sgemm path (many rows) dequantizes in float32: 1e-4 of the largest output.
* Within one kernel set a row's output never depends on the other rows of
  the product (a speculative verify pass must give a one-row step's bits):
  compared bit for bit, rows 1 to 17.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import qmatmul as _qmatmul
from afm_core._mlx import qmm_layers

ext = _qmatmul._ext
needs_ext = pytest.mark.skipif(
    ext is None, reason="afm_core._mlx.qmm_ext is not built (or AFM_NO_QMM / AFM_NO_EXTENSIONS is set)")

ISAS = ext.available_isas() if ext is not None else []
BITS = [2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]
SCALES = [mx.float32, mx.float16, mx.bfloat16]
# K per group: a last chunk of 4 blocks only partly there (27 and 26 blocks)
# and a last run of 16 blocks only partly there (20), for the 512-bit kernels
K_FOR_GROUP = {32: 864, 64: 832, 128: 640}
EPS32 = 2.0**-24


@pytest.fixture
def integer_path():
    ext.set_gemm_rows(0)  # never sgemm
    yield
    ext.set_gemm_rows(-1)
    ext.set_activation_bits(16)


def _weights(n, k, bits, group, scale_dtype=mx.float32, seed=0):
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return q, s.astype(scale_dtype), b.astype(scale_dtype)


def _parts(q, s, b, group, bits):
    """The weights' integers, scales and biases per element, in float64."""
    ones = mx.ones(s.shape, dtype=mx.float32)
    qi = np.array(mx.dequantize(q, ones, mx.zeros_like(ones), group_size=group, bits=bits),
                  dtype=np.float64)
    s64 = np.repeat(np.array(s.astype(mx.float32), dtype=np.float64), group, axis=1)
    b64 = np.repeat(np.array(b.astype(mx.float32), dtype=np.float64), group, axis=1)
    return qi, s64, b64


def _rows(x):
    return np.array(x.astype(mx.float32), dtype=np.float64).reshape(-1, x.shape[-1])


def _reference(x, q, s, b, group, bits):
    qi, s64, b64 = _parts(q, s, b, group, bits)
    return _rows(x) @ (s64 * qi + b64).T


def _float_rounding(x, q, s, b, group, bits):
    """Largest float32 rounding of the kernels' sums, per output (float64)."""
    qi, s64, b64 = _parts(q, s, b, group, bits)
    xn = _rows(x)
    return (xn.shape[1] / 32 + 64) * EPS32 * (np.abs(xn) @ (np.abs(s64 * qi) + np.abs(b64)).T)


def _bound(x, q, s, b, group, bits, act_bits):
    """Largest error the activations' rounding and float32 can cause, per
    output (float64; see the module docstring)."""
    qi, s64, _ = _parts(q, s, b, group, bits)
    xn = _rows(x)
    m, k = xn.shape
    amax = np.repeat(np.abs(xn.reshape(m, k // 32, 32)).max(axis=2), 32, axis=1)
    step = amax / (254.0 if act_bits == 8 else 64516.0)
    return 1.01 * (step @ np.abs(s64 * qi).T) + _float_rounding(x, q, s, b, group, bits)


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("scale_dtype", SCALES, ids=["f32", "f16", "bf16"])
def test_integer_path_within_bound_and_rows_independent(isa, integer_path, bits, group,
                                                        scale_dtype):
    k = K_FOR_GROUP[group]
    q, s, b = _weights(37, k, bits, group, scale_dtype, seed=bits)
    x = mx.random.normal((17, k), key=mx.random.key(group + bits))
    ref = _reference(x, q, s, b, group, bits)
    for act_bits in (16, 8):
        ext.set_activation_bits(act_bits)
        bound = _bound(x, q, s, b, group, bits, act_bits)
        alone = [np.array(ext.quantized_matmul(x[i:i + 1], q, s, b, group, bits))
                 for i in range(17)]
        assert np.all(np.abs(np.concatenate(alone) - ref) <= bound), act_bits
        for rows in range(2, 18):
            y = np.array(ext.quantized_matmul(x[:rows], q, s, b, group, bits))
            for i in range(rows):
                assert np.array_equal(y[i:i + 1], alone[i]), (act_bits, rows, i)


@needs_ext
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_integer_path_exact_on_the_int8_grid(isa, integer_path, bits, group):
    rng = np.random.default_rng(group + bits)
    k = K_FOR_GROUP[group]
    m, n = 9, 72
    d = rng.uniform(0.01, 0.1, size=(m, k // 32, 1))
    qi = rng.integers(-127, 128, size=(m, k // 32, 32))
    qi[:, :, 3] = 127  # each block's maximum is on the grid
    x = mx.array((qi * d).reshape(m, k).astype(np.float32))
    q, s, b = _weights(n, k, bits, group, seed=3 * bits)
    ref = _reference(x, q, s, b, group, bits)
    for act_bits in (16, 8):
        ext.set_activation_bits(act_bits)
        y = np.array(ext.quantized_matmul(x, q, s, b, group, bits), dtype=np.float64)
        assert np.all(np.abs(y - ref) <= _float_rounding(x, q, s, b, group, bits)), act_bits


@needs_ext
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("rows", [64, 300])
def test_sgemm_path_is_float_precise(bits, group, rows):
    if not ext.has_sgemm():
        pytest.skip("no cblas_sgemm in the process")
    q, s, b = _weights(130, 384, bits, group, mx.float16)
    x = mx.random.normal((rows, 384))
    y = np.array(ext.quantized_matmul(x, q, s, b, group, bits), dtype=np.float64)
    ref = _reference(x, q, s, b, group, bits)
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()


@needs_ext
def test_batched_strided_and_half_activations():
    q, s, b = _weights(64, 128, 4, 32)
    x = mx.random.normal((3, 5, 128))
    ref = _reference(x, q, s, b, 32, 4).reshape(3, 5, 64)
    y = ext.quantized_matmul(x, q, s, b, 32, 4)
    assert y.shape == (3, 5, 64)
    bound = _bound(x, q, s, b, 32, 4, 16).reshape(3, 5, 64)
    assert np.all(np.abs(np.array(y) - ref) <= bound)
    xt = mx.random.normal((128, 4)).T  # not row-contiguous
    yt = np.array(ext.quantized_matmul(xt, q, s, b, 32, 4))
    assert np.all(np.abs(yt - _reference(xt, q, s, b, 32, 4)) <= _bound(xt, q, s, b, 32, 4, 16))
    xh = x.astype(mx.float16)
    yh = ext.quantized_matmul(xh, q, s, b, 32, 4)
    assert yh.dtype == mx.float16
    assert np.abs(np.array(yh.astype(mx.float32)) - ref).max() <= 0.05 * np.abs(ref).max()


@needs_ext
def test_rejects_layouts_it_does_not_cover():
    q, s, b = _weights(64, 128, 4, 32)
    for bits in (1, 7, 9):
        with pytest.raises(ValueError, match="bits"):
            ext.quantized_matmul(mx.zeros((1, 128)), q, s, b, 32, bits)
    with pytest.raises(ValueError, match="group_size"):
        ext.quantized_matmul(mx.zeros((1, 128)), q, s, b, 16, 4)
    with pytest.raises(ValueError, match="last dimension"):
        ext.quantized_matmul(mx.zeros((1, 100)), q, s, b, 32, 4)
    with pytest.raises(ValueError, match="scales"):
        ext.quantized_matmul(mx.zeros((1, 128)), q, s[:, :2], b[:, :2], 32, 4)


def test_fallback_is_mlx_quantized_matmul(monkeypatch):
    q, s, b = _weights(64, 128, 4, 32)
    x = mx.random.normal((3, 128))
    monkeypatch.setattr(_qmatmul, "_ext", None)
    y = _qmatmul.quantized_matmul(x, q, s, b, group_size=32, bits=4)
    ref = mx.quantized_matmul(x, q, s, b, group_size=32, bits=4)
    assert mx.array_equal(y, ref)
    assert not _qmatmul.qmm_available()


@pytest.mark.parametrize(("bits", "group", "mode"), [(1, 32, "affine"), (4, 32, "mxfp4"),
                                                     (8, 32, "mxfp8")])
def test_layouts_the_kernels_do_not_cover_stay_on_mlx(bits, group, mode):
    """MLX layouts outside the kernels' (1 bit, the microscaling formats) go
    to ``mx.quantized_matmul`` through the wrapper, and their layers stay
    ``nn.QuantizedLinear``: never an error."""
    w = mx.random.normal((64, 128)) * 0.05
    q, s, *rest = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    b = rest[0] if rest else None
    assert not _qmatmul.supports(q, s, b, group, bits, mode)
    x = mx.random.normal((3, 128))
    y = _qmatmul.quantized_matmul(x, q, s, b, group_size=group, bits=bits, mode=mode)
    ref = mx.quantized_matmul(x, q, s, b, group_size=group, bits=bits, mode=mode)
    assert mx.array_equal(y, ref)
    layer = nn.QuantizedLinear(128, 64, bias=False, group_size=group, bits=bits, mode=mode)
    model = nn.Sequential(layer)
    assert qmm_layers.use_fast_qmm(model) == 0
    assert type(layer) is nn.QuantizedLinear


@needs_ext
@pytest.mark.parametrize("bits", BITS)
def test_every_kernel_width_is_routed_to_the_kernels(bits):
    layer = nn.QuantizedLinear(128, 64, bias=True, group_size=32, bits=bits)
    model = nn.Sequential(layer)
    x = mx.random.normal((2, 128))
    ref = layer(x)
    assert qmm_layers.use_fast_qmm(model) == 1
    assert type(layer).__name__ == "_FastQuantizedLinear"
    y = layer(x)
    bound = _bound(x, layer["weight"], layer["scales"], layer["biases"], 32, bits, 16)
    assert np.all(np.abs(np.array(y) - np.array(ref)) <= bound + 1e-5 * np.abs(np.array(ref)).max())
    qmm_layers.restore_qmm(model)
    assert type(layer) is nn.QuantizedLinear


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
@pytest.mark.parametrize("bits", BITS)
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


@needs_ext
@pytest.mark.parametrize("rows", [3, 80])  # the integer kernels; sgemm (from 64 rows at most)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_split_outputs_with_biases_in_the_input_dtype(dtype, rows):
    """One product as one array per split (sibling projections), each with its
    own bias where given: the same bits as each member's own product plus the
    bias (one float32 addition), rounded once to x's dtype."""
    q, s, b = _weights(96, 256, 4, 32, mx.float16)
    x = mx.random.normal((rows, 256)).astype(dtype)
    bias = [mx.random.normal((40,)).astype(dtype), None, mx.random.normal((16,)).astype(dtype)]
    outs = ext.quantized_matmul_split(x, q, s, b, 32, 4, [40, 40, 16], bias)
    assert [o.shape for o in outs] == [(rows, 40), (rows, 40), (rows, 16)]
    assert all(o.dtype == dtype for o in outs)
    start = 0
    for out, width, bi in zip(outs, [40, 40, 16], bias, strict=True):
        end = start + width
        cols = ext.quantized_matmul(x.astype(mx.float32), q[start:end], s[start:end], b[start:end], 32, 4)
        ref = (cols + bi.astype(mx.float32) if bi is not None else cols).astype(dtype)
        assert mx.array_equal(out, ref), (dtype, start)
        start = end
    one = ext.quantized_matmul(x, q, s, b, 32, 4, mx.random.normal((96,)).astype(dtype))
    assert one.dtype == dtype and one.shape == (rows, 96)


@needs_ext
def test_split_rejects_what_it_cannot_do():
    q, s, b = _weights(64, 128, 4, 32)
    x = mx.zeros((1, 128))
    with pytest.raises(ValueError, match="add up"):
        ext.quantized_matmul_split(x, q, s, b, 32, 4, [32, 16])
    with pytest.raises(ValueError, match="bias"):
        ext.quantized_matmul_split(x, q, s, b, 32, 4, [32, 32], [mx.zeros((16,)), None])
    with pytest.raises(ValueError, match="bias"):
        ext.quantized_matmul(x, q, s, b, 32, 4, mx.zeros((64,), dtype=mx.float16))
    with pytest.raises(ValueError, match="one bias"):
        ext.quantized_matmul_split(x, q, s, b, 32, 4, [32, 32], [None])
    with pytest.raises(ValueError, match="x must be"):
        ext.quantized_matmul(mx.zeros((1, 128), dtype=mx.int32), q, s, b, 32, 4)
