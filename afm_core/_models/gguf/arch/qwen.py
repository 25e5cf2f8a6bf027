"""Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE onto mlx-lm's ``qwen2``, ``qwen3``
and ``qwen3_moe``.

All three use NEOX-style RoPE (rotate-half), as mlx-lm does: no row
permutation.  Qwen2 has biases on q/k/v (mlx-lm's qwen2 always does);
Qwen3 drops them and adds per-head RMS norms on q and k
(``attn_q_norm``/``attn_k_norm``).  Qwen3-MoE replaces the MLP with
``expert_count`` experts (``ffn_{gate,up,down}_exps``, one 3-D tensor each,
which become mlx-lm's ``switch_mlp`` stacks as they are) routed by
``ffn_gate_inp``, top ``expert_used_count``, renormalized as llama.cpp does.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .base import Architecture, Hparams, rope_scaling

__all__ = ["Qwen2", "Qwen3", "Qwen3Moe"]


class Qwen2(Architecture):
    gguf_name = "qwen2"
    model_type = "qwen2"

    def config(self, h: Hparams) -> dict[str, Any]:
        self.no_experts(h)
        config = self.common_config(h)
        self.no_partial_rope(h, config["head_dim"])
        if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
            raise h.error("qwen2 with head_dim * heads != hidden size is not supported by mlx-lm's qwen2")
        if h.info.tensor("blk.0.attn_q.bias") is None:
            raise h.error("qwen2 model without q/k/v biases (mlx-lm's qwen2 expects them)")
        config["architectures"] = ["Qwen2ForCausalLM"]
        config["rope_scaling"] = rope_scaling(h)
        return config


class Qwen3(Architecture):
    gguf_name = "qwen3"
    model_type = "qwen3"
    layer_names: ClassVar[dict[str, str]] = {
        **Architecture.layer_names,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }

    def config(self, h: Hparams) -> dict[str, Any]:
        self.no_experts(h)
        config = self.common_config(h)
        self.no_partial_rope(h, config["head_dim"])
        config["architectures"] = ["Qwen3ForCausalLM"]
        config["rope_scaling"] = rope_scaling(h)
        return config


class Qwen3Moe(Qwen3):
    gguf_name = "qwen3moe"
    model_type = "qwen3_moe"
    layer_names: ClassVar[dict[str, str]] = {
        **Qwen3.layer_names,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
        "ffn_up_exps": "mlp.switch_mlp.up_proj",
        "ffn_down_exps": "mlp.switch_mlp.down_proj",
    }

    def config(self, h: Hparams) -> dict[str, Any]:
        config = self.common_config(h)
        self.no_partial_rope(h, config["head_dim"])
        experts = h.get_int("expert_count")
        config.update({
            "architectures": ["Qwen3MoeForCausalLM"],
            "rope_scaling": rope_scaling(h),
            "num_experts": experts,
            "num_experts_per_tok": h.get_int("expert_used_count"),
            "moe_intermediate_size": h.get_int("expert_feed_forward_length"),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        })
        if h.info.tensor("blk.0.ffn_gate_exps.weight") is None:
            raise h.error("qwen3moe model without blk.0.ffn_gate_exps.weight")
        return config
