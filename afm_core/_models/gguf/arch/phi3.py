"""Phi-3 / Phi-3.5 / Phi-4-mini onto mlx-lm's ``phi3``.

The file keeps Phi-3's fused projections, as mlx-lm does: ``attn_qkv``
becomes ``qkv_proj`` and ``ffn_up`` (gate and up stacked, ``2 *
feed_forward_length`` rows) becomes ``gate_up_proj``.  Partial rotary
embeddings (Phi-4-mini: ``rope.dimension_count`` 96 of 128) set
``partial_rotary_factor``.  LongRoPE models store their per-frequency
factors as ``rope_factors_long``/``rope_factors_short`` tensors; they become
``rope_scaling`` of type ``longrope`` (mlx-lm's ``SuScaledRoPE`` applies the
long factors at every length, as llama.cpp does with a context longer than
``rope.scaling.original_context_length``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from ..reader import tensor_bytes
from .base import Architecture, Hparams, f32

__all__ = ["Phi3"]


class Phi3(Architecture):
    gguf_name = "phi3"
    model_type = "phi3"
    layer_names: ClassVar[dict[str, str]] = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    }
    ignored = frozenset({"rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight"})

    def config(self, h: Hparams) -> dict[str, Any]:
        self.no_experts(h)
        info = h.info
        if info.tensor("blk.0.attn_qkv.weight") is None:
            raise h.error("phi3 model without fused attn_qkv tensors is not supported")
        config = self.common_config(h)
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        if config.pop("head_dim") != head_dim:
            raise h.error("phi3 with head_dim != hidden / heads is not supported by mlx-lm's phi3")
        config["architectures"] = ["Phi3ForCausalLM"]
        config["partial_rotary_factor"] = h.get_int("rope.dimension_count", head_dim) / head_dim
        long = info.tensor("rope_factors_long.weight")
        if long is not None:
            short = info.tensor("rope_factors_short.weight")
            factors = {k: [f32(x) for x in np.asarray(tensor_bytes(info, t), np.float32).reshape(-1)]
                       for k, t in (("long_factor", long), ("short_factor", short or long))}
            config["rope_scaling"] = {"type": "longrope", **factors}
            config["original_max_position_embeddings"] = h.get_int(
                "rope.scaling.original_context_length", 4096)
        elif h.raw("rope.scaling.type", "none") not in ("none", None):
            raise h.error(f"unsupported RoPE scaling for phi3: {h.raw('rope.scaling.type')!r}")
        return config
