"""Gemma 2 and Gemma 3 (text) onto mlx-lm's ``gemma2`` and ``gemma3_text``.

* llama.cpp's converter stores every Gemma RMS norm weight as ``1 + w``
  (Gemma's norm multiplies by ``1 + w``); mlx-lm's Gemma norms add the 1
  themselves, so :meth:`Gemma2.transform_float` subtracts it (exact for the
  stored values: ``(1 + w) - 1`` is exact in float32 whenever ``1 + w``
  is at least 0.5, and within one rounding of ``w`` otherwise).
* Per layer: ``attn_norm`` (input), ``post_attention_norm``, ``ffn_norm``
  (pre-feed-forward), ``post_ffw_norm``; Gemma 3 adds q/k norms.
* The embedding scale (``sqrt(hidden)``) and the tied output head are the
  model's own; soft-capping (Gemma 2: ``attn_logit_softcapping``,
  ``final_logit_softcapping``) comes from the file.
* The query scale is ``1/sqrt(head_dim)``, except for the 27B models, whose
  ``query_pre_attn_scalar`` is ``hidden / heads`` (llama.cpp decides the
  same way, by size).
* Gemma 3 alternates five sliding-window layers (``sliding_window``, local
  RoPE base 10,000) with one global layer (``rope.freq_base``, and the
  file's linear ``rope.scaling`` for the 4B and larger models), the pattern
  llama.cpp hard-codes.  mlx-lm's ``gemma2`` has no sliding window: Gemma 2
  runs every layer globally, which equals llama.cpp up to the window (4,096
  tokens) and differs beyond it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .base import Architecture, Hparams, rope_scaling

__all__ = ["Gemma2", "Gemma3"]

_GEMMA_LAYERS = {
    **Architecture.layer_names,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _query_scalar(config: dict[str, Any]) -> int:
    if config["num_hidden_layers"] in (46, 62):  # the 27B models (Gemma 2, Gemma 3)
        return int(config["hidden_size"] // config["num_attention_heads"])
    return int(config["head_dim"])


class Gemma2(Architecture):
    gguf_name = "gemma2"
    model_type = "gemma2"
    layer_names: ClassVar[dict[str, str]] = _GEMMA_LAYERS

    def config(self, h: Hparams) -> dict[str, Any]:
        self.no_experts(h)
        config = self.common_config(h)
        self.no_partial_rope(h, config["head_dim"])
        if not config["tie_word_embeddings"]:
            raise h.error("gemma2 with a separate output.weight is not supported")
        config["architectures"] = ["Gemma2ForCausalLM"]
        config["query_pre_attn_scalar"] = _query_scalar(config)
        config["attn_logit_softcapping"] = h.get_float("attn_logit_softcapping", 50.0)
        config["final_logit_softcapping"] = h.get_float("final_logit_softcapping", 30.0)
        if h.raw("rope.scaling.type", "none") not in ("none", None):
            raise h.error("rope scaling for gemma2 is not supported")
        return config

    def transform_float(self, mlx_name: str, value: np.ndarray) -> np.ndarray:
        if mlx_name.endswith("norm.weight"):
            return (np.asarray(value, np.float32) - np.float32(1)).astype(np.float32)
        return value


class Gemma3(Gemma2):
    gguf_name = "gemma3"
    model_type = "gemma3_text"
    layer_names: ClassVar[dict[str, str]] = {
        **_GEMMA_LAYERS,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }

    def config(self, h: Hparams) -> dict[str, Any]:
        self.no_experts(h)
        config = self.common_config(h)
        self.no_partial_rope(h, config["head_dim"])
        if not config["tie_word_embeddings"]:
            raise h.error("gemma3 with a separate output.weight is not supported")
        if h.raw("final_logit_softcapping") or h.raw("attn_logit_softcapping"):
            raise h.error("soft-capping in a gemma3 file is not supported (mlx-lm's gemma3 has none)")
        config["architectures"] = ["Gemma3ForCausalLM"]
        config["query_pre_attn_scalar"] = _query_scalar(config)
        config["sliding_window"] = h.get_int("attention.sliding_window", 4096)
        config["sliding_window_pattern"] = 6
        config["rope_local_base_freq"] = 10000.0
        scaling = rope_scaling(h, allow=("linear",))
        config["rope_scaling"] = scaling
        return config
