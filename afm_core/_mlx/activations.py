"""mlx-lm's SwiGLU activation as one operation on the CPU.

mlx-lm's llama-family MLPs compute ``down_proj(swiglu(gate_proj(x),
up_proj(x)))`` with ``swiglu = silu(gate) * up`` compiled by ``mx.compile``.
On the CPU the compiled kernel calls the math library once per element for
its exponential: over a prompt chunk of the default model (2048 positions x
1536) that took as long as a third of the layer's matrix products
(``benchmarks/prefill_profile.py``).  ``qmm_ext.swiglu``
(``ext/qmm/layer_ops.cpp``) computes it with attention's vectorised
exponential, to a few ulp of the exact value (``tests/mlx/test_activations.py``
states the bound).  When ``gate`` and ``up`` are the two outputs of a grouped
gate/up product (:mod:`.qmm_groups`), the product itself computes the
activation in its epilogue instead (:func:`.qmm_groups.fused_swiglu`).

:func:`use_fast_swiglu` points the name ``swiglu`` in the modules of a
model's layers (mlx-lm's ``from .activations import swiglu``) at
:func:`swiglu` here, which takes the kernel for float32 arrays of one shape
on the CPU and mlx-lm's function otherwise; counted per module and given back
by :func:`restore_swiglu`, as :mod:`.attention` does for its kernel.
``AFM_NO_FAST_SWIGLU=1`` keeps mlx-lm's.
"""

from __future__ import annotations

import os
from typing import Protocol, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations as _activations

from . import qmatmul as _qmm
from .qmm_groups import fused_swiglu
from .reference_ops import ModuleRebinding, kernels_allowed

__all__ = ["restore_swiglu", "swiglu", "use_fast_swiglu"]

NO_FAST_SWIGLU_ENV = "AFM_NO_FAST_SWIGLU"
_NAME = "swiglu"
_original = _activations.swiglu


class _Swiglu(Protocol):
    """``qmm_ext.swiglu`` (typed here, beside its one caller)."""

    def swiglu(self, gate: mx.array, up: mx.array) -> mx.array: ...


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's ``swiglu(gate, x)`` (``silu(gate) * x``), as one operation where it applies."""
    ext = _qmm.extension() if kernels_allowed() else None
    if (ext is not None and gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape
            and gate.ndim >= 1 and mx.default_device() == mx.cpu):
        fused = fused_swiglu(gate, x)  # a grouped gate/up product's two outputs: one operation
        return fused if fused is not None else cast(_Swiglu, ext).swiglu(gate, x)
    return cast(mx.array, _original(gate, x))


_REBINDING = ModuleRebinding(_NAME, _original, swiglu, "_afm_swiglu_modules")
"""Where models point mlx-lm's ``swiglu`` at :func:`swiglu`."""


def use_fast_swiglu(model: nn.Module) -> int:
    """Route the SwiGLU of ``model``'s mlx-lm modules through the kernel;
    returns how many modules it applies to (0 without the extension, off the
    CPU, or with ``AFM_NO_FAST_SWIGLU=1``)."""
    if (_qmm.extension() is None or mx.default_device() != mx.cpu
            or os.environ.get(NO_FAST_SWIGLU_ENV, "") not in ("", "0")):
        return 0
    return _REBINDING.use(model)


def restore_swiglu(model: nn.Module) -> int:
    """Undo :func:`use_fast_swiglu` for ``model``: a module gets mlx-lm's
    function back when no other model uses the kernel there."""
    return _REBINDING.restore(model)
