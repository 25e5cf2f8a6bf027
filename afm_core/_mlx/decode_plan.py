"""A llama or qwen2 block's decode step as six straight calls of the extension.

:mod:`.decode_layout`'s block makes a decode step's layer seven operations
(the q/k/v product with the input norm in its prologue and the rotary
embedding in its epilogue, two cache writes, the attention over the cache's
buffers in place, the output product adding the residual, the gate/up
product ending in SwiGLU with the post-attention norm in its prologue, the
down product adding the residual), but it decides each of them again at
every step: which family a projection belongs to, whether its bias can be
added in the product, the norm's weight, the heads' shapes, through a dozen
functions and mlx-lm's ``Module.__getattr__`` (about 15 lookups a layer).
On the default model that was 3 ms of Python per step (0.4 ms of it the
extension's own calls), on a two-core machine taken from the products'
pool worker, which shares a core with the thread building the graph.

:func:`planned_block` makes the same operations with the same arguments
(the same bits: ``tests/mlx/test_decode_layout.py``) from a :class:`Plan`
made once per block: the submodules and the decisions that hang on them
alone.  Each call first checks what can change between steps (the input's
dtype, the cache's kind, room and buffers' dtype, the mask's kind, the
submodules still the planned objects of the planned classes, the module
functions mlx-lm's layers call still afm's) and returns None, having done
nothing, where the block's general call must decide instead.  Weights are
read from their modules at each call, so loading new weights into the same
modules needs no new plan.
"""

from __future__ import annotations

import operator
import sys
import threading
from typing import Any

import mlx.core as mx

from . import activations, attention, half_cache
from . import qmatmul as _qmm
from .fusion import _ROPE_OFFSET_TYPES, RopeEpilogue, _FusedRoPE, one_operation_norm
from .kv_update import update_and_fetch
from .qmatmul import _FastQuantizedLinear, fused_bias, kernel_biases
from .qmm_groups import _Group, _GroupedQuantizedLinear
from .reference_ops import kernels_allowed

__all__ = ["Plan", "planned_block"]

_PLAN = "_afm_decode_plan"
_NO_PLAN = False  # (a block for which no plan can be made)


class Plan:
    """What a block's decode step hangs on that does not change between
    steps: its submodules (and their classes), the q/k/v and gate/up
    families, the heads' shapes and the rotary embedding."""

    __slots__ = ("classes", "down", "heads", "in_norm", "o_proj", "parts", "post_norm", "qkv", "rope",
                 "rope_args", "scale", "swiglu", "width")

    def __init__(self, block: Any) -> None:
        attn, mlp = block["self_attn"], block["mlp"]
        self.in_norm, self.post_norm = block["input_layernorm"], block["post_attention_layernorm"]
        self.o_proj, self.down = attn["o_proj"], mlp["down_proj"]
        q, gate = attn["q_proj"], mlp["gate_proj"]
        self.qkv: _Group = q._group
        self.swiglu: _Group = gate._group
        self.rope: _FusedRoPE = attn.rope
        self.heads = (attn.n_heads, attn.n_kv_heads, attn.n_kv_heads)
        self.scale = float(attn.scale)
        self.width = int(self.o_proj["weight"].shape[0])
        # every object the plan reads and its class (afm swaps classes in
        # place: fusion, families), checked at each call
        self.parts = (attn, mlp, self.in_norm, self.post_norm, q, attn["k_proj"], attn["v_proj"],
                      self.o_proj, self.rope, gate, mlp["up_proj"], self.down)
        self.classes = tuple(map(type, self.parts))
        # (its frequencies, dims and traditional; the offset is each step's)
        self.rope_args: RopeEpilogue | None = self.rope.epilogue(1, self.qkv.splits[0] // self.heads[0], 0)

    def holds(self, block: Any) -> bool:
        """Whether ``block`` still holds the planned submodules, of their
        planned classes, in the planned families."""
        attn, mlp = block.get("self_attn"), block.get("mlp")
        if attn is None or mlp is None:
            return False
        parts = (attn, mlp, block.get("input_layernorm"), block.get("post_attention_layernorm"), attn.get("q_proj"),
                 attn.get("k_proj"), attn.get("v_proj"), attn.get("o_proj"), attn.get("rope"),
                 mlp.get("gate_proj"), mlp.get("up_proj"), mlp.get("down_proj"))
        return (all(map(operator.is_, parts, self.parts))
                and tuple(map(type, parts)) == self.classes
                and parts[4]._group is self.qkv and parts[9]._group is self.swiglu)


def _make_plan(block: Any) -> Plan | None:
    """A plan for ``block`` (an mlx-lm llama or qwen2 block in its decode
    layout) when its parts are the ones :mod:`.decode_layout` turns into the
    six operations; None otherwise."""
    attn, mlp = block.get("self_attn"), block.get("mlp")
    if attn is None or mlp is None or type(attn.get("rope")) is not _FusedRoPE or "q_norm" in attn:
        return None
    members = [attn.get(k) for k in ("q_proj", "k_proj", "v_proj")]
    if any(type(m) is not _GroupedQuantizedLinear for m in members):
        return None
    group = members[0]._group
    if group.members != members or [m._index for m in members] != [0, 1, 2]:
        return None
    gate, up = mlp.get("gate_proj"), mlp.get("up_proj")
    if type(gate) is not _GroupedQuantizedLinear or type(up) is not _GroupedQuantizedLinear:
        return None
    if not gate._group.swiglu or up._group is not gate._group or (gate._index, up._index) != (0, 1):
        return None
    if type(attn.get("o_proj")) is not _FastQuantizedLinear or type(mlp.get("down_proj")) is not _FastQuantizedLinear:
        return None
    heads = (attn.n_heads, attn.n_kv_heads, attn.n_kv_heads)
    if any(n % h for n, h in zip(group.splits, heads, strict=True)):
        return None
    if group.splits[0] // heads[0] != group.splits[1] // heads[1]:
        return None  # (the epilogue embeds queries and keys of one head size)
    plan = Plan(block)
    if plan.width != int(plan.down["weight"].shape[0]) or plan.rope_args is None:
        return None
    return plan


def _bias(layer: Any, x: mx.array) -> tuple[bool, mx.array | None]:
    """Whether the product can add ``layer``'s bias (``fused_bias``), or it has none, and the bias."""
    bias = fused_bias(layer, x)
    return bias is not None or "bias" not in layer, bias


class _Offsets(threading.local):
    """The last int offset a thread's plans embedded, as the array the
    rotary epilogue reads (every layer of a step has the same: one array)."""

    value: int | None = None
    array: mx.array | None = None


_offsets = _Offsets()


def _rope_offset(offset: Any, rows: int) -> mx.array | None:
    """A cache's offset as the rotary epilogue's (``_FusedRoPE.epilogue``'s
    rules: an int, or an array of one value or one per row), or None."""
    if isinstance(offset, int):
        if _offsets.value != offset:
            _offsets.array, _offsets.value = mx.array(offset, dtype=mx.int32), offset
        return _offsets.array
    if (isinstance(offset, mx.array) and offset.dtype in _ROPE_OFFSET_TYPES
            and (offset.ndim == 0 or offset.shape == (rows,))):
        return offset
    return None


def planned_block(block: Any, x: mx.array, mask: Any, cache: Any) -> mx.array | None:
    """``block(x, mask, cache)`` at one position per row as the six
    operations of :mod:`.decode_layout`'s block, by its plan (made at the
    first call); None, having done nothing, where the block's general call
    must decide (see the module docstring)."""
    plan = block.__dict__.get(_PLAN)
    if plan is None:
        plan = _make_plan(block) or _NO_PLAN
        object.__setattr__(block, _PLAN, plan)
    if plan is _NO_PLAN or not plan.holds(block):
        return None
    ext = _qmm.extension()
    kind = type(cache)
    if (ext is None or x.dtype != mx.float32 or x.ndim != 3 or x.shape[2] != plan.width or not kernels_allowed()
            or (kind is not half_cache.KVCache and kind is not half_cache.BatchKVCache)
            or cache.keys is None or cache.keys.dtype != cache.values.dtype
            or cache.keys.dtype not in (mx.float32, mx.float16)
            or not (mask is None or isinstance(mask, str)
                    or (isinstance(mask, mx.array) and mask.dtype in (mx.bool_, mx.float32)))
            or mx.default_device() != mx.cpu):
        return None
    batch = kind is half_cache.BatchKVCache
    prev = cache._idx if batch else cache.offset
    if prev + 1 > cache.keys.shape[2]:
        return None  # (mlx-lm's update grows the buffers)
    module = sys.modules[type(block).__module__]
    if (module.scaled_dot_product_attention is not attention.scaled_dot_product_attention
            or module.swiglu is not activations.swiglu):
        return None
    in_norm, post_norm = one_operation_norm(plan.in_norm), one_operation_norm(plan.post_norm)
    if in_norm is None or post_norm is None:
        return None
    qkv = plan.qkv
    biases = [_bias(m, x) for m in qkv.members]
    o_fits, o_bias = _bias(plan.o_proj, x)
    down_fits, down_bias = _bias(plan.down, x)
    if not (o_fits and down_fits and all(fits for fits, _ in biases)):
        return None
    rows = x.shape[0]
    offset = _rope_offset(cache.offset, rows)
    if offset is None:
        return None
    shapes = [(rows, h, 1, n // h) for n, h in zip(qkv.splits, plan.heads, strict=True)]

    rope = plan.rope_args
    assert rope is not None  # (_make_plan)
    queries, keys, values = ext.quantized_matmul_split(
        x, qkv.weight, qkv.scales, qkv.kernel_biases, qkv.group_size, qkv.bits, qkv.splits,
        [bias for _, bias in biases], in_norm[0], in_norm[1], shapes, offset, rope.freqs, rope.dims,
        rope.traditional, 2)
    update_and_fetch(cache, keys, values, fetch=False)  # (its one-operation writes: checked above)
    filled = cache._idx if batch else cache.offset
    causal = isinstance(mask, str)
    heads = ext.decode_attention(queries, cache.keys, cache.values, plan.scale,
                                 None if causal else attention._scores_mask(mask, queries, filled),
                                 causal, filled, True)
    o = plan.o_proj
    h = ext.quantized_matmul(heads, o["weight"], o["scales"], kernel_biases(o), o.group_size, o.bits, o_bias, x)
    gu = plan.swiglu
    act = ext.quantized_matmul_swiglu(h, gu.weight, gu.scales, gu.kernel_biases, gu.group_size, gu.bits,
                                      post_norm[0], post_norm[1])
    d = plan.down
    return ext.quantized_matmul(act, d["weight"], d["scales"], kernel_biases(d), d.group_size, d.bits, down_bias, h)
