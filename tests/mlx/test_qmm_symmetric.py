"""Symmetric weights: every bias ``-2^(bits-1)`` times its scale (GGUF's
Q4_0, Q5_0, Q8_0, Q6_K as the conversion writes them).  The kernels take a
0-d ``biases`` argument for them and make each bias from its scale, so a
one-row product does not read the bias plane; the outputs must be the bits
of the same product with the biases themselves, on every kernel set, both
activation precisions and the sgemm path."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import qmatmul as _qmatmul

ext = _qmatmul._ext
pytestmark = pytest.mark.skipif(
    ext is None, reason="afm_core._mlx.qmm_ext is not built (or AFM_NO_QMM / AFM_NO_EXTENSIONS is set)")

ISAS = ext.available_isas() if ext is not None else []
BITS = [2, 3, 4, 5, 6, 8]


@pytest.fixture
def act_bits(request):
    ext.set_activation_bits(request.param)
    yield request.param
    ext.set_activation_bits(16)


def _symmetric(n, k, bits, group, dtype, seed=0):
    """A weight whose biases are exactly -2^(bits-1) times its scales."""
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05
    q, s, _ = mx.quantize(w, group_size=group, bits=bits)
    s = s.astype(dtype)
    c = -(1 << (bits - 1))
    return q, s, s * c, mx.array(c, dtype=dtype)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("act_bits", [16, 8], indirect=True)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_the_factor_gives_the_bits_of_the_biases(isa, act_bits, bits, group, dtype):
    q, s, b, c = _symmetric(72, 640, bits, group, dtype)
    for rows in (1, 3, 80):  # the integer kernels; 80: sgemm (from 64 rows at most)
        x = mx.random.normal((rows, 640), key=mx.random.key(rows))
        with_biases = ext.quantized_matmul(x, q, s, b, group, bits)
        with_factor = ext.quantized_matmul(x, q, s, c, group, bits)
        assert mx.array_equal(with_biases, with_factor).item(), rows


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_split_and_swiglu_products_take_the_factor(isa):
    q, s, b, c = _symmetric(96, 256, 5, 32, mx.float16)
    x = mx.random.normal((2, 256), key=mx.random.key(1))
    norm = mx.random.uniform(shape=(256,), key=mx.random.key(2))
    split_b = ext.quantized_matmul_split(x, q, s, b, 32, 5, [64, 32], [None, None], norm, 1e-5)
    split_c = ext.quantized_matmul_split(x, q, s, c, 32, 5, [64, 32], [None, None], norm, 1e-5)
    assert all(mx.array_equal(u, v).item() for u, v in zip(split_b, split_c, strict=True))
    swiglu_b = ext.quantized_matmul_swiglu(x, q, s, b, 32, 5)
    swiglu_c = ext.quantized_matmul_swiglu(x, q, s, c, 32, 5)
    assert mx.array_equal(swiglu_b, swiglu_c).item()


def test_a_zero_factor_is_zero_biases():
    q, s, _, _ = _symmetric(40, 256, 4, 32, mx.float16)
    x = mx.random.normal((1, 256), key=mx.random.key(3))
    zero = ext.quantized_matmul(x, q, s, mx.array(0.0, dtype=mx.float16), 32, 4)
    assert mx.array_equal(zero, ext.quantized_matmul(x, q, s, mx.zeros_like(s), 32, 4)).item()


def test_rejects_biases_of_other_shapes_and_types():
    q, s, b, _ = _symmetric(40, 256, 4, 32, mx.float16)
    x = mx.zeros((1, 256))
    for bad in (b[:, :2], mx.array([-8.0], dtype=mx.float16), b.astype(mx.float32),
                mx.array(-8, dtype=mx.int32)):
        with pytest.raises(ValueError, match="biases"):
            ext.quantized_matmul(x, q, s, bad, 32, 4)


@pytest.mark.parametrize("bits", BITS)
def test_symmetric_factor_finds_exactly_the_symmetric_weights(bits):
    _, s, b, c = _symmetric(40, 256, bits, 32, mx.float16)
    factor = _qmatmul.symmetric_factor(s, b, bits)
    assert factor is not None and factor.ndim == 0 and factor.dtype == mx.float16
    assert factor.item() == c.item() == -(2 ** (bits - 1))
    assert _qmatmul.symmetric_factor(s, b, 4 if bits != 4 else 5) is None  # another width's factor
    off = np.array(b)
    off[7, 3] = np.nextafter(off[7, 3], np.float16(0))  # one bias a step off
    assert _qmatmul.symmetric_factor(s, mx.array(off), bits) is None
    _, s_affine, b_affine = mx.quantize(mx.random.normal((40, 256)), group_size=32, bits=bits)
    found = _qmatmul.symmetric_factor(s_affine, b_affine, bits)
    if bits > 2:
        assert found is None  # MLX's own layout: a bias of its own per group
    else:  # (MLX's 2-bit groups come out symmetric: then the factor is theirs)
        assert found is not None and mx.array_equal(b_affine, s_affine * found).item()
    assert _qmatmul.symmetric_factor(s, b.astype(mx.float32), bits) is None


def test_a_bias_that_overflowed_is_not_symmetric():
    s = mx.full((4, 8), 1000.0, dtype=mx.float16)
    b = s * -128  # -inf in float16, where the kernels' float32 product is -128000
    assert _qmatmul.symmetric_factor(s, b, 8) is None
    assert _qmatmul.symmetric_factor(s, s * -2, 2) is not None


def _make_symmetric(model, bits):
    for _, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m["scales"] = m["scales"].astype(mx.float16)
            m["biases"] = m["scales"] * -(1 << (bits - 1))
    mx.eval(model.parameters())


def _kernel_layers(model):
    return [m for _, m in model.named_modules()
            if isinstance(m, (_qmatmul._FastQuantizedLinear, _qmatmul._FastQuantizedEmbedding))]


@pytest.mark.parametrize("bits", [4, 8])
def test_a_model_of_symmetric_weights_decodes_the_same_bits(tmp_path, bits):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from afm_core._mlx.fusion import fuse_cpu_kernels, unfuse_cpu_kernels
    from afm_core.testing import make_random_model

    path = make_random_model(tmp_path / "m", hidden_size=128, num_layers=2, intermediate_size=256, seed=3)
    model, _ = load_model(path)
    nn.quantize(model, group_size=32, bits=bits)  # the output head is a tied QuantizedEmbedding
    _make_symmetric(model, bits)
    fuse_cpu_kernels(model, transpose=False)

    layers = _kernel_layers(model)
    assert layers and all(_qmatmul.kernel_biases(m).ndim == 0 for m in layers)
    groups = {id(m._group): m._group for m in layers if hasattr(m, "_group")}
    assert groups and all(g.kernel_biases.ndim == 0 for g in groups.values())

    def decode():
        cache = make_prompt_cache(model)
        outs = [model(mx.array([[5, 17, 256, 3, 99]]), cache=cache)]
        for token in (42, 7, 11):  # one-position steps: the planned decode step
            outs.append(model(mx.array([[token]]), cache=cache))
        mx.eval(outs)
        return outs

    noted = decode()
    for m in layers:
        _qmatmul.forget_symmetric(m)
    for g in groups.values():
        g.kernel_biases = g.biases
    assert all(_qmatmul.kernel_biases(m) is m["biases"] for m in layers)
    plain = decode()
    assert all(mx.array_equal(u, v).item() for u, v in zip(noted, plain, strict=True))

    unfuse_cpu_kernels(model)
    assert not any("_afm_symmetric" in m.__dict__ for _, m in model.named_modules())


def test_new_weights_drop_the_note(tmp_path):
    from mlx_lm.utils import load_model

    from afm_core._mlx.fusion import fuse_cpu_kernels
    from afm_core.testing import make_random_model

    path = make_random_model(tmp_path / "m", hidden_size=128, num_layers=1, intermediate_size=256, seed=4)
    model, _ = load_model(path)
    nn.quantize(model, group_size=32, bits=4)
    _make_symmetric(model, 4)
    fuse_cpu_kernels(model, transpose=False)
    head = next(m for m in _kernel_layers(model) if isinstance(m, _qmatmul._FastQuantizedEmbedding))
    assert _qmatmul.kernel_biases(head).ndim == 0
    head["biases"] = head["biases"] + 0.01  # no longer symmetric: the product must use these
    x = mx.random.normal((1, 1, 128), key=mx.random.key(5))
    assert _qmatmul.kernel_biases(head) is head["biases"]
    assert "_afm_symmetric" not in head.__dict__
    expected = ext.quantized_matmul(x, head["weight"], head["scales"], head["biases"], 32, 4)
    assert mx.array_equal(head.as_linear(x), expected).item()
