"""Sibling quantized projections that read the same input, as one product.

A llama-style layer computes ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)``
from one ``x``, then ``gate_proj(x)`` and ``up_proj(x)`` from another: five
products where two would do.  On MLX's CPU backend each product is an
operation of its own (a task for MLX's scheduler, a hand-off to the kernels'
thread pool, its own quantization of the same activations), which for the
small matrices of a decode step costs about as much as the arithmetic.

:func:`group_siblings` concatenates each such family's quantized weights,
scales and biases into one matrix (the layers' own parameters become row
slices of it: views, no second copy) and makes the layers share one
:class:`_Group`: the first member called with an input computes the whole
product as one operation with one output per member
(``qmm_ext.quantized_matmul_split``: no slice operations, and no member's
array keeps its siblings' columns alive), each member's bias (Qwen2's q/k/v
biases) added by that same operation; each member returns its own output.
Every output row is computed exactly as it was alone (the kernels quantize
each activation row once and compute each output row on its own; the bias is
the same one float32 addition), so results are the same bits
(``tests/mlx/test_qmm_groups.py``).  A member called with a different input
than its siblings computes its own slice of the weights instead, so a model
that does not call them together stays correct.

A SwiGLU MLP's gate/up family goes one step further: mlx-lm computes
``swiglu(gate_proj(x), up_proj(x))``, and :func:`fused_swiglu` (which
:func:`afm_core._mlx.activations.swiglu` asks first) recognises the family's
two outputs of the last product on this thread and returns
``qmm_ext.quantized_matmul_swiglu`` of the same input instead: the
activation computed in the product's epilogue, so neither ``gate`` nor ``up``
is ever a whole array (the two lazy outputs are dropped unevaluated).  On a
prompt chunk that is two of the MLP's three (tokens x intermediate) float32
arrays gone; on a decode step one operation fewer per layer.  Same bits as
the two operations (``tests/mlx/test_qmm_groups.py``).  The family keeps only
weak references to what it served, so it holds nothing alive.

``AFM_NO_QMM_GROUPS=1`` leaves the layers apart (for comparisons);
``AFM_NO_QMM_SWIGLU=1`` keeps the grouped product and the activation apart.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import qmatmul as _qmm

__all__ = ["SIBLINGS", "fused_swiglu", "group_siblings", "ungroup_siblings"]

_SWIGLU_FAMILY = ("gate_proj", "up_proj")
SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), _SWIGLU_FAMILY)
"""Families of a module's children that read the same input (mlx-lm's names)."""

NO_GROUPS_ENV = "AFM_NO_QMM_GROUPS"
NO_SWIGLU_ENV = "AFM_NO_QMM_SWIGLU"

Norm = tuple[mx.array, float]
Rope = tuple[mx.array, mx.array, int, bool]
"""A rotary epilogue: ``rope_decode``'s offset, frequencies, dims and traditional."""
"""An RMS norm's weight and eps, computed in a product's prologue."""

_served = threading.local()
"""``pair``: weak references to the last SwiGLU family's outputs served on
this thread, their input and the family (MLX work stays on one thread)."""


class _Group:
    """One family's concatenated weight and the last product computed with it."""

    __slots__ = (
        "__weakref__",
        "_left",
        "_outs",
        "_x",
        "biases",
        "bits",
        "group_size",
        "kernel_biases",
        "members",
        "scales",
        "splits",
        "swiglu",
        "weight",
    )

    def __init__(self, layers: list[Any], swiglu: bool = False) -> None:
        self.weight = mx.concatenate([layer["weight"] for layer in layers], axis=0)
        self.scales = mx.concatenate([layer["scales"] for layer in layers], axis=0)
        self.biases = mx.concatenate([layer["biases"] for layer in layers], axis=0)
        mx.eval(self.weight, self.scales, self.biases)
        self.group_size: int = layers[0].group_size
        self.bits: int = layers[0].bits
        # the kernels' biases argument (a symmetric weight's factor: qmatmul.symmetric_factor)
        factor = _qmm.symmetric_factor(self.scales, self.biases, self.bits)
        self.kernel_biases: mx.array = self.biases if factor is None else factor
        self.members: list[Any] = layers
        self.splits: list[int] = [int(layer["weight"].shape[0]) for layer in layers]
        self._x: mx.array | None = None
        self._outs: list[mx.array] | None = None
        self._left: set[int] = set()
        self.swiglu = swiglu  # a gate/up family whose product can end in SwiGLU

    def bounds(self, index: int) -> tuple[int, int]:
        """Member ``index``'s rows of the family's matrix."""
        start = sum(self.splits[:index])
        return start, start + self.splits[index]

    def product(self, x: mx.array, norm: Norm | None = None,
                shapes: Sequence[Sequence[int]] | None = None, rope: Rope | None = None) -> list[mx.array]:
        """Every member's output for ``x`` (its bias added) from the family's
        one product; with ``norm`` (an RMS norm's weight and eps, float32),
        for ``rms_norm(x)`` computed in the product's prologue; with
        ``shapes``, each output in its shape (the same elements in the same
        order); with ``rope`` (``rope_decode``'s offset, frequencies, dims
        and traditional), the first two outputs (queries and keys, shaped as
        heads) embedded in the product's epilogue."""
        ext = _qmm.extension()
        assert ext is not None
        weight, eps = norm if norm is not None else (None, 0.0)
        biases = [_qmm.fused_bias(layer, x) for layer in self.members]
        offset, freqs, dims, traditional = rope if rope is not None else (None, None, 0, False)
        outs = ext.quantized_matmul_split(x, self.weight, self.scales, self.kernel_biases, self.group_size,
                                          self.bits, self.splits, biases, weight, eps, shapes or [],
                                          offset, freqs, dims, traditional, 0 if rope is None else 2)
        for i, (layer, bias) in enumerate(zip(self.members, biases, strict=True)):
            if "bias" in layer and bias is None:  # a bias the product cannot add
                outs[i] = outs[i] + layer["bias"]
        return outs

    def columns(self, x: mx.array, index: int) -> mx.array:
        """Member ``index``'s output for ``x`` (its bias added), from the
        family's one product (made by the first member asked for ``x``)."""
        if self._x is not x:
            self._x = x
            self._outs = self.product(x)
            self._left = set(range(len(self.splits)))
        outs = self._outs
        assert outs is not None
        self._left.discard(index)
        if not self._left:  # every member served: hold no activations between calls
            if self.swiglu and x.dtype == mx.float32:
                _served.pair = tuple(weakref.ref(o) for o in (outs[0], outs[1], x, self))
            self._x = self._outs = None
        return outs[index]

    def swiglu_product(self, x: mx.array, norm: Norm | None = None) -> mx.array:
        """``silu(gate) * up`` of the family's product of ``x`` (of
        ``rms_norm(x)`` with ``norm``), as one operation."""
        ext = _qmm.extension()
        assert ext is not None
        weight, eps = norm if norm is not None else (None, 0.0)
        return ext.quantized_matmul_swiglu(x, self.weight, self.scales, self.kernel_biases,
                                           self.group_size, self.bits, weight, eps)


class _GroupedQuantizedLinear(_qmm._FastQuantizedLinear):
    """A member of a :class:`_Group` (its own parameters are views of the group's)."""

    _group: _Group
    _index: int

    def __call__(self, x: mx.array) -> mx.array:
        return self._group.columns(x, self._index)


def _groupable(layers: list[Any]) -> bool:
    first = layers[0]
    return all(
        type(layer) is _qmm._FastQuantizedLinear
        and layer.bits == first.bits and layer.group_size == first.group_size
        and layer["weight"].shape[1] == first["weight"].shape[1]
        and layer["scales"].dtype == first["scales"].dtype
        for layer in layers)


def family_swiglu(gate: Any, up: Any, x: mx.array, norm: Norm | None = None) -> mx.array | None:
    """``silu(gate(x)) * up(x)`` as one product when ``gate`` and ``up`` are
    a gate/up family's two members and ``x`` is float32 (what
    :func:`fused_swiglu` recognises after the fact, without making the
    members' outputs first); of ``rms_norm(x)`` with ``norm`` (see
    :meth:`_Group.columns`); None otherwise."""
    if type(gate) is not _GroupedQuantizedLinear or type(up) is not _GroupedQuantizedLinear:
        return None
    group = gate._group
    if not group.swiglu or up._group is not group or (gate._index, up._index) != (0, 1) or x.dtype != mx.float32:
        return None
    return group.swiglu_product(x, norm)


def family_outputs(layers: tuple[Any, ...], x: mx.array, norm: Norm | None,
                   heads: tuple[int, ...] | None, rope: Rope | None = None) -> list[mx.array] | None:
    """Each of ``layers``' output for ``x`` (B, 1, K) (for ``rms_norm(x)``
    with ``norm``: its weight and eps, the norm in the product's prologue)
    from their family's one product, shaped (B, heads[i], 1, width /
    heads[i]) (the same elements; ``heads`` None: (B, 1, width)), when
    ``layers`` are a whole family in order, without biases added after the
    product, and ``x`` is float32; None otherwise.  With ``rope`` (and
    ``heads``), the first two outputs get ``rope_decode`` in the product's
    epilogue (:meth:`_Group.product`)."""
    first = layers[0]
    if type(first) is not _GroupedQuantizedLinear or x.dtype != mx.float32:
        return None
    group = first._group
    if len(layers) != len(group.members) or any(
            type(layer) is not _GroupedQuantizedLinear or layer._group is not group or layer._index != i
            for i, layer in enumerate(layers)):
        return None
    if x.ndim != 3 or x.shape[1] != 1 or (heads is not None and any(
            n % h for n, h in zip(group.splits, heads, strict=True))):
        return None
    if any("bias" in layer and _qmm.fused_bias(layer, x) is None for layer in layers):
        return None  # (a bias added after the product: the outputs keep their shapes)
    if heads is None:
        return group.product(x, norm) if rope is None else None
    shapes = [(x.shape[0], h, 1, n // h) for n, h in zip(group.splits, heads, strict=True)]
    if rope is not None and (len(shapes) < 2 or shapes[0][3] != shapes[1][3]):
        return None
    return group.product(x, norm, shapes, rope)


def layer_outputs(layers: tuple[Any, ...], x: mx.array, norm: Norm | None,
                  heads: tuple[int, ...] | None) -> list[mx.array] | None:
    """What :func:`family_outputs` gives, for siblings left apart (their
    weights differ in bits, say: Q4_K_M files keep some layers' values at
    6 bits): each layer's own product with the norm in its prologue and
    its output in its heads' shape (a one-member split product: the same
    rows as the layer's call), when each is one of afm's quantized layers
    whose product adds its bias, and ``x`` is float32 (B, 1, K); None
    otherwise."""
    ext = _qmm.extension()
    if ext is None or x.dtype != mx.float32 or x.ndim != 3 or x.shape[1] != 1:
        return None
    if any(type(layer) is not _qmm._FastQuantizedLinear or ("bias" in layer and _qmm.fused_bias(layer, x) is None)
           for layer in layers):
        return None
    widths = [int(layer["weight"].shape[0]) for layer in layers]
    if heads is not None and any(n % h for n, h in zip(widths, heads, strict=True)):
        return None
    weight, eps = norm if norm is not None else (None, 0.0)
    outs = []
    for i, (layer, n) in enumerate(zip(layers, widths, strict=True)):
        shapes = [] if heads is None else [(x.shape[0], heads[i], 1, n // heads[i])]
        outs.extend(ext.quantized_matmul_split(x, layer["weight"], layer["scales"], _qmm.kernel_biases(layer),
                                               layer.group_size, layer.bits, [n], [_qmm.fused_bias(layer, x)],
                                               weight, eps, shapes))
    return outs


def fused_swiglu(gate: mx.array, up: mx.array) -> mx.array | None:
    """``silu(gate) * up`` as one product when ``gate`` and ``up`` are the two
    outputs a gate/up family served last on this thread (see the module
    docstring); None otherwise (the caller computes it from the arrays)."""
    pair = getattr(_served, "pair", None)
    if pair is None:
        return None
    gate_ref, up_ref, x_ref, group_ref = pair
    x, group = x_ref(), group_ref()
    if gate_ref() is not gate or up_ref() is not up or x is None or group is None:
        return None
    _served.pair = None
    return group.swiglu_product(x)


def _swiglu_family(names: tuple[str, ...], layers: list[Any]) -> bool:
    return (names == _SWIGLU_FAMILY and not any("bias" in layer for layer in layers)
            and os.environ.get(NO_SWIGLU_ENV, "") in ("", "0"))


def group_siblings(model: nn.Module) -> int:
    """Group ``model``'s sibling projections that run on afm's quantized
    kernels (see the module docstring); returns how many families changed."""
    if _qmm.extension() is None or os.environ.get(NO_GROUPS_ENV, "") not in ("", "0"):
        return 0
    families = 0
    for _, parent in model.named_modules():
        children = parent.children() if isinstance(parent, nn.Module) else {}
        for names in SIBLINGS:
            found = [children.get(name) for name in names]
            layers: list[Any] = [layer for layer in found if layer is not None]
            if len(layers) < len(names) or not _groupable(layers):
                continue
            group = _Group(layers, swiglu=_swiglu_family(names, layers))
            for index, layer in enumerate(layers):
                a, b = group.bounds(index)
                layer["weight"] = group.weight[a:b]
                layer["scales"] = group.scales[a:b]
                layer["biases"] = group.biases[a:b]
                mx.eval(layer["weight"], layer["scales"], layer["biases"])
                layer.__class__ = _GroupedQuantizedLinear
                object.__setattr__(layer, "_group", group)
                object.__setattr__(layer, "_index", index)
            families += 1
    if families:
        mx.clear_cache()  # the layers' own buffers, freed: back to the system, not MLX's cache
    return families


def ungroup_siblings(model: nn.Module) -> int:
    """Make :func:`group_siblings`'s members plain fast layers again (their
    parameters stay views of the family's matrix); returns how many changed."""
    changed = 0
    for _, layer in model.named_modules():
        if isinstance(layer, _GroupedQuantizedLinear):
            object.__delattr__(layer, "_group")
            object.__delattr__(layer, "_index")
            fast: type[Any] = _qmm._FastQuantizedLinear
            layer.__class__ = fast
            changed += 1
    return changed
