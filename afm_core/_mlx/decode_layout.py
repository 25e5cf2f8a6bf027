"""A decode step's layers with fewer MLX operations, the same bits.

On the CPU backend a decode step of a small model costs in proportion to its
operations, not its arithmetic: each one is a task for MLX's scheduler (and
the thread building the next step's graph may run at most about a hundred
of them ahead of the one computing, see ``benchmarks/README.md``).  mlx-lm's
llama, qwen2, qwen3 and Gemma 3 (``gemma3_text``) layers, called on one
position per row, make several that compute nothing:

* the attention shapes its queries, keys and values to (B, L, H, D) and
  transposes them to (B, H, L, D), and its output back the other way; with
  L = 1 the (B, H, 1, D) layout holds the same elements in the same order,
  so the q/k/v family's product writes its outputs in that shape
  (``qmm_groups.family_outputs``) and the attention kernel writes its
  output as (B, 1, H x D) (``decode_attention``'s ``merge_heads``): eight
  reshapes and transposes fewer.  The queries' and keys' rotary
  embeddings are one operation (``_FusedRoPE.pair``), or none of their
  own where the q/k/v family's product embeds them in its epilogue
  (llama and qwen2: no per-head norms between; ``_FusedRoPE.epilogue``,
  the same code on the product's outputs), and the attention
  reads the cache's buffers in place up to the positions they hold
  (``attention.decode_heads``) instead of through two slices;
* a float16 cache (:mod:`.half_cache`, the engine's default) casts the
  keys and values to float16 and writes each with a slice update; one
  operation per buffer does both (:func:`update_and_fetch`);
* the block adds each residual as an operation of its own after the
  attention's output product and after the MLP's down product; the product
  can add it in its epilogue (``qmm_ext.quantized_matmul``'s ``residual``:
  the one float32 addition the add would make), so the block layouts
  skip the two additions.  Their MLP asks the gate/up family's SwiGLU
  product for its activation directly (``qmm_groups.family_swiglu``)
  instead of making the two projections' outputs for ``swiglu`` to
  recognise: the same operation, built with less Python per step;
* each of the block's two norms is an operation of its own before the
  q/k/v and the gate/up product; those products compute it in their
  prologue (the same row code, so the same bits), two operations fewer.
  Siblings a file quantizes at different bits (Q4_K_M's 6-bit values) are
  not one family: each then makes its own product, the norm in its
  prologue and the heads in its output shape all the same
  (``qmm_groups.layer_outputs``).

A layer's decode is then 7 operations (the default model's step: 270
instead of 897).  A llama or qwen2 block makes them from a plan made at its
first decode step (:mod:`.decode_plan`: the same calls without deciding
them again each step), where the plan's checks pass.

Gemma 3's attention is qwen3's (norms of each head's query and key) on two
kinds of cache: its global layers' plain one, and its sliding-window
layers' ``RotatingKVCache`` (``BatchRotatingKVCache`` in a batch), which
keeps its float32 buffers and mlx-lm's update (the write at the rotating
index, the growth and trim); the attention then reads the first positions
of its buffers that mlx-lm's ``keys_and_values`` would return, in place
(a slice of them until the window fills, then all of them in the order
the rotation left them: the arrays mlx-lm's attention reads, and its mask).
In a batch whose sliding layers share the first one's offset
(:func:`.batch.share_offsets`), the others write while their windows fill
without mlx-lm's ``mx.depends`` on their own offset (:func:`rotating_write`):
three operations fewer each.
Its block norms each sublayer's output too, before the residual
(``clip_residual``, an addition in float32), so the residuals stay
operations of their own; the block layout computes the input and
pre-feedforward norms in the q/k/v and gate/up products' prologues, and
the MLP's ``gelu_approx(gate) * up`` stays mlx-lm's (afm's products have
no GELU epilogue).  Gemma's norms (``rms_norm`` by ``1 + weight``) are
one operation each from :mod:`.fusion`; a Gemma-3-270M step is 408
operations instead of 688 (1,996 before its norms were fused).

Other calls (prompts, verify steps of more than one position, no cache)
are mlx-lm's own, and so are the layers of other architectures and layers
whose parts differ from mlx-lm's (an MLP of another class, say).  :func:`use_decode_layout` swaps
the classes of a model's layers in place (``AFM_NO_DECODE_LAYOUT=1``: it
does not), :func:`restore_decode_layout` gives mlx-lm's back;
``tests/mlx/test_decode_layout.py`` checks the bits against mlx-lm's layers.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as _cache

from . import activations, attention
from .batch import shares_offset
from .decode_plan import planned_block
from .fusion import _FusedRoPE, one_operation_norm
from .kv_update import filled_positions, rotating_write, update_and_fetch
from .qmatmul import residual_product
from .qmm_groups import _GroupedQuantizedLinear, family_outputs, family_swiglu, layer_outputs
from .reference_ops import kernels_allowed

__all__ = ["NO_DECODE_LAYOUT_ENV", "restore_decode_layout", "update_and_fetch", "use_decode_layout"]

NO_DECODE_LAYOUT_ENV = "AFM_NO_DECODE_LAYOUT"

_QKV_NORMED = ("mlx_lm.models.qwen3", "mlx_lm.models.gemma3_text")
"""The architectures whose attention norms each head's query and key."""


def _norm_args(norm: Any, x: mx.array) -> tuple[mx.array, float] | None:
    """``norm``'s weight and eps when a product's prologue computes what
    ``norm(x)`` would (an afm norm on the extension's kernel, float32)."""
    if x.dtype != mx.float32 or not kernels_allowed():
        return None
    return one_operation_norm(norm)


def _products(layers: tuple[Any, ...], x: mx.array, norm: Any, heads: tuple[int, ...] | None) -> list[mx.array]:
    """Each of ``layers``' output of ``x`` (of ``norm(x)`` with a norm), in
    ``heads``' shapes (B, H, 1, D) (None: (B, 1, width)): their family's
    one product, or each layer's own where the family was left apart, the
    norm in the prologue and the heads in the output shape, where it can
    be; else the norm, the layers' calls and reshapes."""
    args = _norm_args(norm, x) if norm is not None else None
    if norm is None or args is not None:
        for outputs in (family_outputs, layer_outputs):
            outs = outputs(layers, x, args, heads)
            if outs is not None:
                return outs
    if norm is not None:
        return _products(layers, norm(x), None, heads)
    if heads is None:
        return [layer(x) for layer in layers]
    return [layer(x).reshape(x.shape[0], h, 1, -1) for layer, h in zip(layers, heads, strict=True)]


def _heads(attn: Any, x: mx.array, norm: Any) -> list[mx.array]:
    """``attn``'s queries, keys and values of ``x`` (of ``norm(x)`` with a
    norm), each (B, H, 1, D), by :func:`_products`."""
    return _products((attn.q_proj, attn.k_proj, attn.v_proj), x, norm,
                     (attn.n_heads, attn.n_kv_heads, attn.n_kv_heads))


def _embedded_heads(attn: Any, x: mx.array, norm: Any, offset: Any) -> list[mx.array] | None:
    """``attn``'s queries, keys and values of ``x`` (of ``norm(x)``), each
    (B, H, 1, D), the queries' and keys' positions embedded, from the q/k/v
    family's one product with the rotary embedding in its epilogue (the bits
    of :func:`_heads` then :func:`_embed_positions`); None where that product
    does not apply."""
    rope = attn.rope
    if type(rope) is not _FusedRoPE or type(attn.q_proj) is not _GroupedQuantizedLinear:
        return None
    args = _norm_args(norm, x) if norm is not None else None
    if norm is not None and args is None:
        return None
    epilogue = rope.epilogue(x.shape[0], attn.q_proj._group.splits[0] // attn.n_heads, offset)
    if epilogue is None:
        return None
    return family_outputs((attn.q_proj, attn.k_proj, attn.v_proj), x, args,
                          (attn.n_heads, attn.n_kv_heads, attn.n_kv_heads),
                          (epilogue.offset, epilogue.freqs, epilogue.dims, epilogue.traditional))


def _embed_positions(rope: Any, queries: mx.array, keys: mx.array, offset: Any) -> tuple[mx.array, mx.array]:
    """``rope`` of the queries and of the keys, as one operation where it can be."""
    pair = rope.pair(queries, keys, offset) if type(rope) is _FusedRoPE else None
    if pair is not None:
        return pair
    return rope(queries, offset=offset), rope(keys, offset=offset)


def _attention_layout(base: type) -> type:
    """``base`` (an mlx-lm ``Attention``) whose call at one position per row
    makes fewer operations (see the module docstring)."""

    def attend(self: Any, x: mx.array, mask: Any, cache: Any, norm: Any = None) -> mx.array:
        """The heads' output at one position per row, (B, 1, H x D), before
        the output product; with ``norm`` (the block's input norm), of
        ``norm(x)``."""
        heads = None if normed else _embedded_heads(self, x, norm, cache.offset)
        if heads is not None:
            queries, keys, values = heads
        else:
            queries, keys, values = _heads(self, x, norm)
            if normed:
                queries, keys = self.q_norm(queries), self.k_norm(keys)
            queries, keys = _embed_positions(self.rope, queries, keys, cache.offset)
        if type(cache) is _cache.BatchRotatingKVCache and shares_offset(cache) \
                and rotating_write(cache, keys, values):
            fetched = None
        else:
            fetched = update_and_fetch(cache, keys, values, fetch=False)
        filled = filled_positions(cache)
        if filled is not None and module.scaled_dot_product_attention is attention.scaled_dot_product_attention:
            # the cache's buffers read in place, the output in (B, 1, H x D)
            merged = attention.decode_heads(queries, cache.keys, cache.values, filled, cache, self.scale, mask)
            if merged is not None:
                return merged
        keys, values = fetched if fetched is not None else cache.keys_and_values()
        output = module.scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                     scale=self.scale, mask=mask)
        return output.reshape(x.shape[0], 1, -1)  # type: ignore[no-any-return]

    def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if x.shape[1] != 1 or cache is None:
            return base.__call__(self, x, mask=mask, cache=cache)  # type: ignore[no-any-return]
        return self.o_proj(attend(self, x, mask, cache))  # type: ignore[no-any-return]

    module = sys.modules[base.__module__]
    normed = base.__module__ in _QKV_NORMED
    return type(base.__name__, (base,), {"__call__": __call__, "attend": attend, "__module__": base.__module__,
                                         "__qualname__": f"DecodeLayout.{base.__qualname__}"})


def _activation(mlp: Any, norm: Any, h: mx.array, swiglu: Any) -> mx.array:
    """``swiglu(gate(norm(h)), up(norm(h)))`` of ``mlp``: the gate/up
    family's one SwiGLU product (the norm in its prologue where it can be)
    when ``swiglu`` is afm's, else the two projections and ``swiglu``."""
    n = None
    if swiglu is activations.swiglu and kernels_allowed():
        args = _norm_args(norm, h)
        act = family_swiglu(mlp.gate_proj, mlp.up_proj, h, args) if args is not None else None
        if act is not None:
            return act
        n = norm(h)
        act = family_swiglu(mlp.gate_proj, mlp.up_proj, n)
        if act is not None:
            return act
    n = norm(h) if n is None else n
    return swiglu(mlp.gate_proj(n), mlp.up_proj(n))  # type: ignore[no-any-return]


def _block_layout(base: type) -> type:
    """``base`` (an mlx-lm ``TransformerBlock``) whose call at one position
    per row adds each residual in the product before it."""

    def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if x.shape[1] != 1 or cache is None:
            return base.__call__(self, x, mask=mask, cache=cache)  # type: ignore[no-any-return]
        if planned:
            out = planned_block(self, x, mask, cache)
            if out is not None:
                return out
        attn = self.self_attn
        h = residual_product(attn.o_proj, attn.attend(x, mask, cache, self.input_layernorm), x)
        act = _activation(self.mlp, self.post_attention_layernorm, h, module.swiglu)
        return residual_product(self.mlp.down_proj, act, h)

    module = sys.modules[base.__module__]
    planned = base.__module__ not in _QKV_NORMED  # (:mod:`.decode_plan`: llama and qwen2)
    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                         "__qualname__": f"DecodeLayout.{base.__qualname__}"})


def _gemma_block_layout(base: type) -> type:
    """``base`` (Gemma 3's ``TransformerBlock``) whose call at one position
    per row computes its input and pre-feedforward norms in the q/k/v and
    gate/up products' prologues.  (Its post-norms come between each product
    and its residual, so the residuals stay additions of their own.)"""

    def __call__(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if x.shape[1] != 1 or cache is None:
            return base.__call__(self, x, mask=mask, cache=cache)  # type: ignore[no-any-return]
        attn, mlp = self.self_attn, self.mlp
        r = attn.o_proj(attn.attend(x, mask, cache, self.input_layernorm))
        h = module.clip_residual(x, self.post_attention_layernorm(r))
        gate, up = _products((mlp.gate_proj, mlp.up_proj), h, self.pre_feedforward_layernorm, None)
        r = mlp.down_proj(nn.gelu_approx(gate) * up)
        return module.clip_residual(h, self.post_feedforward_layernorm(r))  # type: ignore[no-any-return]

    module = sys.modules[base.__module__]
    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                         "__qualname__": f"DecodeLayout.{base.__qualname__}"})


def _layouts() -> tuple[dict[type, type], dict[type, tuple[type, type, type]]]:
    """The attention layouts by mlx-lm class, and the block layouts by block
    class with the attention and MLP classes a block must hold."""
    from mlx_lm.models import gemma3_text, llama, qwen2, qwen3

    attention: dict[type, type] = {}
    blocks: dict[type, tuple[type, type, type]] = {}
    for m in (llama, qwen2, qwen3, gemma3_text):
        attention[m.Attention] = _attention_layout(m.Attention)
        layout = _gemma_block_layout if m is gemma3_text else _block_layout
        blocks[m.TransformerBlock] = (layout(m.TransformerBlock), m.Attention, m.MLP)
    return attention, blocks


_ATTENTION, _BLOCKS = _layouts()
_SWAPPED = frozenset([*_ATTENTION.values(), *(layout for layout, _, _ in _BLOCKS.values())])


def use_decode_layout(model: nn.Module) -> int:
    """Give ``model``'s llama, qwen2, qwen3 and Gemma 3 attention layers and blocks
    their decode layouts, in place; returns how many layers changed (0 with
    ``AFM_NO_DECODE_LAYOUT=1``)."""
    if os.environ.get(NO_DECODE_LAYOUT_ENV, "") not in ("", "0"):
        return 0
    changed = 0
    for _, layer in model.named_modules():
        block = _BLOCKS.get(type(layer))
        if block is not None:
            layout, attention, mlp = block
            if type(getattr(layer, "self_attn", None)) in (attention, _ATTENTION[attention]) \
                    and type(getattr(layer, "mlp", None)) is mlp:
                layer.__class__ = layout
                changed += 1
        elif type(layer) in _ATTENTION:
            layer.__class__ = _ATTENTION[type(layer)]
            changed += 1
    return changed


def restore_decode_layout(model: nn.Module) -> int:
    """Give ``model``'s layers mlx-lm's classes back; returns how many changed."""
    changed = 0
    for _, layer in model.named_modules():
        if type(layer) in _SWAPPED:
            layer.__class__ = type(layer).__mro__[1]
            changed += 1
    return changed
