"""afm_core._mlx.activations: the SwiGLU kernel against the exact value and mlx-lm's.

``qmm_ext.swiglu`` computes ``g * sigmoid(g) * u`` with sigmoid(g) from
t = e^-|g| (the attention kernels' exponential, within 2 ulp: 4u, u = 2^-24):
``1 / (1 + t)`` or ``t / (1 + t)``, one rounding for the sum and one for the
quotient, then two products, one rounding each: within (4 + 2 + 2) u = 8u of
the exact value relatively, 9u with the bound's own rounding.  Below e^-87 the
exponential is flushed to zero (float32's normal range ends there), so a
result may also be off by |g| e^-87 |u| absolutely.  mlx-lm's compiled
``silu(g) * u`` is checked against the same exact value (its own accuracy).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_swiglu

import afm_core  # noqa: F401  (binds the BLAS under MLX first)
from afm_core._mlx import activations as _activations
from afm_core._mlx import qmatmul as _qmatmul

ext: Any = _qmatmul.extension()
needs_ext = pytest.mark.skipif(ext is None, reason="afm_core._mlx.qmm_ext is not built or disabled")
U = 2.0 ** -24
REL = 9 * U


def _exact(g: mx.array, u: mx.array) -> np.ndarray:
    g64, u64 = np.array(g, dtype=np.float64), np.array(u, dtype=np.float64)
    with np.errstate(over="ignore"):
        return g64 / (1.0 + np.exp(-g64)) * u64


def _within(got: mx.array, want: np.ndarray, rel: float, g: mx.array, u: mx.array) -> None:
    got64 = np.array(got, dtype=np.float64)
    flushed = np.abs(np.array(g, dtype=np.float64) * np.array(u, dtype=np.float64)) * np.exp(-87.0)
    err = np.abs(got64 - want)
    assert np.all(err <= rel * np.abs(want) + flushed), float(np.max(err - rel * np.abs(want) - flushed))


@needs_ext
@pytest.mark.parametrize("shape", [(1, 2048, 1536), (3, 1, 1536), (1, 7, 13), (5,)])
def test_matches_the_exact_value_and_mlx_lm(shape):
    mx.random.seed(len(shape))
    g = mx.random.normal(shape) * 6.0
    u = mx.random.normal(shape)
    got = ext.swiglu(g, u)
    want = _exact(g, u)
    _within(got, want, REL, g, u)
    _within(mlx_swiglu(g, u), want, 64 * U, g, u)  # mlx-lm's, within a few ulp too


@needs_ext
def test_extremes_and_strided_rows():
    g = mx.array([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, 1e30, -1e30,
                  3.0, -3.0, 0.5, -0.5], dtype=mx.float32)
    u = mx.ones_like(g) * 1.5
    got = ext.swiglu(g, u)
    assert np.all(np.isfinite(np.array(got)))
    _within(got, _exact(g, u), REL, g, u)
    # columns of a wider product (as a grouped projection's members are at decode): strided rows
    mx.random.seed(2)
    y = mx.random.normal((4, 64))
    g2, u2 = y[:, :24], y[:, 32:56]
    _within(ext.swiglu(g2, u2), _exact(g2, u2), REL, g2, u2)


@needs_ext
def test_wrapper_takes_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    real = ext.swiglu

    class Spy:
        def __getattr__(self, name):
            return getattr(ext, name)

        def swiglu(self, *a):
            calls.append(a)
            return real(*a)

    monkeypatch.setattr(_qmatmul, "_ext", Spy())
    g, u = mx.random.normal((2, 8)), mx.random.normal((2, 8))
    _activations.swiglu(g, u)
    assert len(calls) == 1
    _activations.swiglu(g.astype(mx.bfloat16), u.astype(mx.bfloat16))  # mlx-lm's
    _activations.swiglu(g, u[:, :1])  # broadcasting: mlx-lm's
    assert len(calls) == 1


@needs_ext
def test_a_fused_model_uses_it_and_gives_it_back(random_model_dir):
    import sys

    import mlx_lm

    from afm_core._mlx.fusion import fuse_for_cpu, unfuse_cpu_kernels

    model = mlx_lm.load(str(random_model_dir))[0]
    module = sys.modules[type(model.layers[0].mlp).__module__]
    x = mx.array([[5, 6, 7, 8, 9]])
    ref = model(x)
    before = module.swiglu  # (mlx-lm's, unless a model another test fused is still alive)
    fuse_for_cpu(model)
    assert module.swiglu is _activations.swiglu
    fused = model(x)
    assert float(mx.max(mx.abs(fused - ref))) <= 1e-4 * float(mx.max(mx.abs(ref)))
    unfuse_cpu_kernels(model)
    assert module.swiglu is before
    if before is mlx_swiglu:  # the last user gave mlx-lm's function back
        assert _activations._REBINDING.users.get(module.__name__) is None


@needs_ext
def test_gradients_match_mlx_lm():
    """A model whose module has the kernel can be trained (a LoRA adapter in the same process)."""
    mx.random.seed(7)
    g = mx.random.normal((3, 5, 64)) * 4.0
    u = mx.random.normal((3, 5, 64))
    w = mx.random.normal((3, 5, 64))

    def loss(fn):
        return lambda a, b: (fn(a, b) * w).sum()

    got = mx.grad(loss(ext.swiglu), argnums=(0, 1))(g, u)
    want = mx.grad(loss(mlx_swiglu), argnums=(0, 1))(g, u)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
