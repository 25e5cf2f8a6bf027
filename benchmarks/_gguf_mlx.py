"""A real Qwen2 GGUF as an mlx-lm model directory, for the kernel benchmarks.

Until afm's own GGUF converter reads qwen2 files, the decode benchmarks build
their models as issue 29 did: every tensor of the GGUF dequantized to float32
with the ``gguf`` package (``gguf.quants.dequantize``), mapped onto mlx-lm's
``qwen2`` names, saved in ``--dtype`` (float32: the activations' dtype on the
CPU), then quantized to MLX's affine layout (``bits``, ``group``) with mlx-lm's
own ``quantize_model``, the scales and biases stored as ``--scales`` (float16:
5 bits per weight at 4 bits, group 32, as issue 29 measured).  The result is
cached under ``$AFM_HOME/bench-models/`` (``~/.cache/afm``), keyed by the
file's name, size and the settings.  No tokenizer is written: the benchmarks
feed token ids (llama.cpp's tokenization of their text).

    .venv/bin/python benchmarks/_gguf_mlx.py ~/.cache/afm/downloads/real/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --bits 4 --group 32 --scales float16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["build", "gguf_config"]

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
        "output_norm.weight": "model.norm.weight"}


def _home() -> Path:
    return Path(os.environ.get("AFM_HOME") or Path.home() / ".cache" / "afm")


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


def gguf_config(reader: Any) -> dict[str, Any]:
    """mlx-lm's qwen2 ``config.json`` from the GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "qwen2":
        raise SystemExit(f"this benchmark builder reads qwen2 GGUFs, not {arch!r}")
    names = {t.name for t in reader.tensors}
    vocab = next(t for t in reader.tensors if t.name == "token_embd.weight").shape.tolist()[1]
    return {
        "model_type": "qwen2",
        "hidden_size": _field(reader, "qwen2.embedding_length"),
        "intermediate_size": _field(reader, "qwen2.feed_forward_length"),
        "num_hidden_layers": _field(reader, "qwen2.block_count"),
        "num_attention_heads": _field(reader, "qwen2.attention.head_count"),
        "num_key_value_heads": _field(reader, "qwen2.attention.head_count_kv"),
        "rms_norm_eps": _field(reader, "qwen2.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, "qwen2.rope.freq_base"),
        "max_position_embeddings": _field(reader, "qwen2.context_length"),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
    }


def _hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{_LAYER[rest]}"


def build(gguf: Path, bits: int = 4, group: int = 32, dtype: str = "float32",
          scales: str = "float16", home: Path | None = None) -> Path:
    """The mlx-lm directory of ``gguf`` requantized to ``bits``/``group``
    with ``scales`` scales and biases (``bits`` 0: the dequantized ``dtype``
    weights), built once and cached."""
    st = gguf.stat()
    kind = "f" if bits == 0 else f"q{bits}g{group}-{scales}"
    tag = f"{gguf.stem}-{st.st_size}-{kind}-{dtype}"
    out = (home or _home()) / "bench-models" / tag
    if (out / "config.json").exists():
        return out
    import mlx.core as mx
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    reader = GGUFReader(str(gguf))
    config = gguf_config(reader)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {}
    for t in reader.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(reversed(t.shape.tolist()))
        weights[_hf_name(t.name)] = mx.array(a.reshape(shape)).astype(getattr(mx, dtype))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights)
    del weights
    with open(tmp / "config.json", "w") as f:
        json.dump(config, f)
    model, config = load_model(tmp, lazy=True)
    if bits:
        model, config = quantize_model(model, config, group_size=group, bits=bits)
        import mlx.nn as nn

        for _, layer in model.named_modules():
            if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                layer["scales"] = layer["scales"].astype(getattr(mx, scales))
                layer["biases"] = layer["biases"].astype(getattr(mx, scales))
    (tmp / "model.safetensors").unlink()
    save_model(tmp, model, donate_model=True)
    save_config(config, config_path=tmp / "config.json")
    tmp.rename(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--bits", type=int, default=4, help="0: dequantized weights")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--dtype", default="float32", help="the float weights and activations")
    ap.add_argument("--scales", default="float16", help="the quantized layers' scales and biases")
    args = ap.parse_args()
    print(build(args.gguf, args.bits, args.group, args.dtype, args.scales))
    return 0


if __name__ == "__main__":
    sys.exit(main())
