"""llama (Llama 2/3.x, Mistral 7B, SmolLM, ...) onto mlx-lm's ``llama``.

* llama.cpp permutes the rows of ``attn_q``/``attn_k`` for its interleaved
  ("normal") RoPE; :meth:`Llama.row_order` undoes that, so mlx-lm's
  rotate-half RoPE runs the weights.
* Llama 3.1+ rope scaling is stored only as per-frequency factors
  (``rope_freqs.weight``); the usual parameters are recovered and checked
  against them (:func:`llama3_scaling`), so an unknown variant fails instead
  of running wrong.
* A Mistral-style ``llama.attention.sliding_window`` (Mistral 7B v0.1's
  4,096 tokens) is ignored, as llama.cpp ignores it for ``llama`` files: every
  layer attends to the whole context, so afm computes what llama.cpp computes
  on the same file (mlx-lm's ``llama`` could not run an all-sliding model
  anyway: it needs one full-attention layer).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...._errors import GGUFError
from ..reader import GGUFInfo, TensorInfo, tensor_bytes
from .base import Architecture, Hparams, f32, rope_scaling

__all__ = ["Llama", "llama3_rope_factors", "llama3_scaling"]


def llama3_rope_factors(
    head_dim: int, base: float, factor: float, low: float, high: float, old_context: int
) -> np.ndarray:
    """Per-frequency RoPE factors as llama.cpp's converter writes ``rope_freqs``."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_context / high, 1.0, np.where(wavelen > old_context / low, factor, mid))


def llama3_scaling(h: Hparams, t: TensorInfo, head_dim: int) -> dict[str, Any]:
    """Llama 3.1-style ``rope_scaling`` recovered from the ``rope_freqs`` tensor."""
    info: GGUFInfo = h.info
    if t.type_name != "F32":
        raise h.error(f"rope_freqs.weight of type {t.type_name} is not supported")
    factors = np.asarray(tensor_bytes(info, t), dtype=np.float64).reshape(-1)
    base = float(h.raw("rope.freq_base", 10000.0))
    factor = float(factors.max())
    for low, high, old in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384), (1.0, 2.0, 8192)):
        ref = llama3_rope_factors(head_dim, base, factor, low, high, old)
        if ref.shape == factors.shape and np.allclose(ref, factors, rtol=1e-4, atol=1e-6):
            return {"rope_type": "llama3", "factor": f32(factor), "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": old}  # fmt: skip
    raise h.error("per-frequency RoPE factors (rope_freqs.weight) that match no known "
                  "llama 3 rope_scaling are not supported")


def unpermute_order(rows: int, n_head: int) -> np.ndarray:
    """Row indices that undo llama.cpp's ``permute`` of a Q or K projection."""
    if rows % (2 * n_head):
        raise GGUFError(f"cannot undo the Q/K permutation: {rows} rows for {n_head} heads")
    idx = np.arange(rows).reshape(n_head, rows // n_head // 2, 2)
    return idx.swapaxes(1, 2).reshape(rows)


class Llama(Architecture):
    gguf_name = "llama"
    model_type = "llama"

    def config(self, h: Hparams) -> dict[str, Any]:
        self.no_experts(h)
        config = self.common_config(h)
        self.no_partial_rope(h, config["head_dim"])
        info = h.info
        config["architectures"] = ["LlamaForCausalLM"]
        config["attention_bias"] = info.tensor("blk.0.attn_q.bias") is not None
        config["mlp_bias"] = info.tensor("blk.0.ffn_up.bias") is not None
        freqs = info.tensor("rope_freqs.weight")
        if freqs is not None:
            config["rope_scaling"] = llama3_scaling(h, freqs, config["head_dim"])
        else:
            config["rope_scaling"] = rope_scaling(h)
        return config

    def row_order(self, mlx_name: str, config: dict[str, Any]) -> np.ndarray | None:
        if ".self_attn.q_proj." in mlx_name:
            heads = config["num_attention_heads"]
        elif ".self_attn.k_proj." in mlx_name:
            heads = config["num_key_value_heads"]
        else:
            return None
        return unpermute_order(heads * config["head_dim"], heads)
