"""A model's quantized layers on afm's quantized kernels, and back.

:func:`use_fast_qmm` switches a model's ``nn.QuantizedLinear`` layers, and a
quantized embedding used as the output head (``as_linear``), to the fast
layer classes of :mod:`.qmatmul` in place (a class swap, as
``afm_core._mlx.fusion`` does), then groups the sibling projections
(:mod:`.qmm_groups`); :func:`restore_qmm` undoes both.
``afm_core._mlx.fusion.fuse_cpu_kernels`` calls both.  It sits above the two
modules it joins: :mod:`.qmm_groups` builds on :mod:`.qmatmul`'s layers.
"""

from __future__ import annotations

import mlx.nn as nn

from . import qmatmul as _qmm
from .qmm_groups import group_siblings, ungroup_siblings

__all__ = ["restore_qmm", "use_fast_qmm"]


def use_fast_qmm(model: nn.Module) -> int:
    """Switch ``model``'s ``nn.QuantizedLinear`` and ``nn.QuantizedEmbedding``
    layers (exactly those classes, in a layout the kernels cover) to the fast
    kernels, in place; returns how many changed (0 without the extension or off
    the CPU)."""
    if _qmm.extension() is None or not _qmm._on_cpu():
        return 0
    changed = 0
    for _, layer in model.named_modules():
        if type(layer) is nn.QuantizedLinear and _qmm._layer_supported(layer):
            layer.__class__ = _qmm._FastQuantizedLinear
        elif type(layer) is nn.QuantizedEmbedding and _qmm._layer_supported(layer):
            layer.__class__ = _qmm._FastQuantizedEmbedding
        else:
            continue
        changed += 1
    group_siblings(model)  # q/k/v and gate/up as one product each
    for _, layer in model.named_modules():  # (after grouping: members' arrays are views then)
        if isinstance(layer, (_qmm._FastQuantizedLinear, _qmm._FastQuantizedEmbedding)):
            _qmm.note_symmetric(layer)
    return changed


def restore_qmm(model: nn.Module) -> int:
    """Give ``model`` back the layers :func:`use_fast_qmm` switched; returns
    how many changed."""
    ungroup_siblings(model)
    changed = 0
    for _, layer in model.named_modules():
        if _qmm.is_kquant(layer):
            continue  # its blocks have no MLX layer to go back to (afm_core._mlx.kquant)
        if isinstance(layer, (_qmm._FastQuantizedLinear, _qmm._FastQuantizedEmbedding)):
            _qmm.forget_symmetric(layer)
            layer.__class__ = layer.__class__.__mro__[1]
            changed += 1
    return changed
