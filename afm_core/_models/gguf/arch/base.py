"""What every architecture shares: reading hyperparameters, naming tensors.

An :class:`Architecture` turns a GGUF file's ``{arch}.*`` metadata into an
mlx-lm ``config.json`` (:meth:`Architecture.config`), each GGUF tensor name
into the mlx-lm parameter it becomes (:meth:`Architecture.map_name`), and
says what changes on the way: a row order (llama's Q/K permutation, exact on
quantized rows since a quantization group never spans two rows) or a float
transform (Gemma's stored ``1 + w`` norms).  The names follow llama.cpp's
``gguf-py/gguf/tensor_mapping.py`` and ``transformers.integrations.ggml``'s
config tables, which these modules were written from.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import numpy as np

from ...._errors import GGUFError
from ..reader import GGUFInfo

__all__ = ["Architecture", "Hparams", "f32"]

_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_0-9]+)\.(weight|bias)$")


def f32(value: Any) -> float:
    """A GGUF float32 scalar as the shortest float that round-trips."""
    return float(str(np.float32(value)))


class Hparams:
    """The ``{arch}.*`` keys of one GGUF file, with clear errors."""

    def __init__(self, info: GGUFInfo, arch: str) -> None:
        self.info = info
        self.arch = arch
        self.path = info.path

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.info.metadata

    def raw(self, key: str, default: Any = None) -> Any:
        return self.info.get(f"{self.arch}.{key}", default)

    def get_int(self, key: str, default: int | None = None) -> int:
        value = self.raw(key, default)
        if value is None:
            raise GGUFError(f"{self.path}: missing GGUF metadata key '{self.arch}.{key}'")
        if isinstance(value, np.ndarray):
            if value.size == 0 or not np.all(value == value.flat[0]):
                raise GGUFError(f"{self.path}: per-layer {self.arch}.{key} values are not supported")
            value = value.flat[0]
        return int(value)

    def get_float(self, key: str, default: float | None = None) -> float:
        value = self.raw(key, default)
        if value is None:
            raise GGUFError(f"{self.path}: missing GGUF metadata key '{self.arch}.{key}'")
        return f32(value)

    def error(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")


class Architecture:
    """One GGUF ``general.architecture`` and the mlx-lm model it converts to."""

    gguf_name: ClassVar[str]
    model_type: ClassVar[str]
    #: GGUF per-layer tensor base name -> mlx-lm module under ``model.layers.N``
    layer_names: ClassVar[dict[str, str]] = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    top_names: ClassVar[dict[str, str]] = {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    }
    #: tensors llama.cpp writes that the mlx-lm model recomputes or ignores
    ignored: ClassVar[frozenset[str]] = frozenset({"rope_freqs.weight"})

    def map_name(self, name: str) -> str | None:
        """The mlx-lm parameter for GGUF tensor ``name`` (None: not needed)."""
        if name in self.ignored:
            return None
        m = _TENSOR_RE.match(name)
        if m is not None:
            layer, base, kind = m.groups()
            if layer is None and base in self.top_names:
                return f"{self.top_names[base]}.{kind}"
            if layer is not None and base in self.layer_names:
                return f"model.layers.{layer}.{self.layer_names[base]}.{kind}"
        raise GGUFError(f"unexpected GGUF tensor {name!r} for a {self.gguf_name} model")

    def config(self, h: Hparams) -> dict[str, Any]:
        raise NotImplementedError

    def row_order(self, mlx_name: str, config: dict[str, Any]) -> np.ndarray | None:
        """A permutation of ``mlx_name``'s rows (None: as stored)."""
        return None

    def transform_float(self, mlx_name: str, value: np.ndarray) -> np.ndarray:
        """A float tensor's values for mlx-lm (default: as stored)."""
        return value

    # --- shared pieces of config() ---------------------------------------------------

    def common_config(self, h: Hparams) -> dict[str, Any]:
        """The keys every mlx-lm decoder takes, from the usual GGUF keys."""
        info = h.info
        hidden = h.get_int("embedding_length")
        heads = h.get_int("attention.head_count")
        head_dim = h.get_int("attention.key_length", hidden // heads)
        if h.get_int("attention.value_length", head_dim) != head_dim:
            raise h.error("different key and value head sizes are not supported")
        embd = info.tensor("token_embd.weight")
        if embd is None:
            raise h.error("no token_embd.weight tensor")
        tokens = info.get("tokenizer.ggml.tokens")
        config: dict[str, Any] = {
            "model_type": self.model_type,
            "hidden_size": hidden,
            "num_hidden_layers": h.get_int("block_count"),
            "intermediate_size": h.get_int("feed_forward_length"),
            "num_attention_heads": heads,
            "num_key_value_heads": h.get_int("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": h.get_float("attention.layer_norm_rms_epsilon", 1e-5),
            "vocab_size": h.get_int("vocab_size", len(tokens) if tokens is not None else embd.shape[0]),
            "rope_theta": h.get_float("rope.freq_base", 10000.0),
            "max_position_embeddings": h.get_int("context_length", 4096),
            "tie_word_embeddings": info.tensor("output.weight") is None,
        }
        if embd.shape[0] != config["vocab_size"]:
            raise h.error(f"token_embd.weight has {embd.shape[0]} rows for a vocabulary of "
                          f"{config['vocab_size']}")
        for key in ("bos", "eos"):
            tid = info.get(f"tokenizer.ggml.{key}_token_id")
            if tid is not None:
                config[f"{key}_token_id"] = int(tid)
        return config

    def no_partial_rope(self, h: Hparams, head_dim: int) -> None:
        rope_dim = h.get_int("rope.dimension_count", head_dim)
        if rope_dim != head_dim:
            raise h.error(f"partial rotary embeddings ({rope_dim} of {head_dim}) are not supported "
                          f"for {self.gguf_name}")

    def no_experts(self, h: Hparams) -> None:
        if h.raw("expert_count"):
            raise h.error(f"mixture-of-experts {self.gguf_name} ({self.gguf_name}.expert_count) "
                          "is not supported")


def rope_scaling(h: Hparams, *, allow: tuple[str, ...] = ("linear", "yarn")) -> dict[str, Any] | None:
    """``rope_scaling`` from ``{arch}.rope.scaling.*`` (none, linear or YaRN)."""
    kind = h.raw("rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind not in allow:
        raise h.error(f"unsupported RoPE scaling type {kind!r} (supported: none, {', '.join(allow)})")
    factor = h.get_float("rope.scaling.factor", 1.0)
    if kind == "linear":
        return None if factor == 1.0 else {"type": "linear", "factor": factor}
    out: dict[str, Any] = {"type": "yarn", "rope_type": "yarn", "factor": factor,
                           "original_max_position_embeddings": h.get_int("rope.scaling.original_context_length")}
    return out
