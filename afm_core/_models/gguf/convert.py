"""Convert llama-architecture GGUF files into mlx-lm model directories.

``convert_gguf(src, dst)`` writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files of
:mod:`afm_core._models.gguf.tokenizer` into ``dst`` atomically (a temporary sibling
directory renamed into place), so a killed conversion never leaves a
half-written model behind.

Tensor types:

* ``F32``/``F16``/``BF16``: stored as ``dtype`` (float32 by default).
* ``Q4_0``/``Q4_1``/``Q8_0``: ``mlx.core.load`` already returns them as MLX
  affine triplets with ``group_size=32`` -- exactly: Q4_1 is ``d*q + m``
  (scale ``d``, bias ``m``), Q4_0 is ``d*(q-8)`` (bias ``-8d``), Q8_0 is
  ``d*q`` for signed ``q`` (unsigned ``q+128``, bias ``-128d``).  They stay
  quantized with scales/biases cast to ``dtype`` (exact: the GGUF scales are
  float16), or become ``dtype`` weights with ``dequantize=True``.
* anything else (K-quants, IQ types, ...): :class:`GGUFError` naming the type.

llama.cpp permutes the rows of ``attn_q``/``attn_k`` for its interleaved RoPE;
the importer undoes that so the standard (non-traditional) mlx-lm llama model
runs the weights.  Row permutations are exact on quantized weights, since a
quantization group never spans rows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..._errors import GGUFError, ModelLoadError
from .reader import GGUFInfo, TensorInfo, read_gguf_info
from .tokenizer import build_tokenizer_files

__all__ = [
    "CONVERTER_VERSION",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TYPES",
    "auto_dequantize",
    "convert_gguf",
    "remove_partials",
]

#: Bumped whenever the output of the converter changes (cache keys use it).
CONVERTER_VERSION = 1
SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
_QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_GROUP_SIZE = 32
_DTYPES = ("float32", "float16", "bfloat16")

#: Largest model auto-dequantized on CPU (1e9 parameters = 4 GB of float32).
AUTO_DEQUANTIZE_MAX_PARAMS = 1_000_000_000

Progress = Callable[[str], None]


def count_parameters(info: GGUFInfo) -> int:
    """Number of weights in a GGUF file (all tensors)."""
    return sum(int(np.prod(t.shape)) for t in info.tensors)


def auto_dequantize(n_params: int) -> bool:
    """Whether Q4/Q8 weights should be dequantized to float32 by default.

    MLX's own CPU quantized matmul is slower than float32 GEMM/GEMV (measured
    in benchmarks/gguf_model.py), so without afm's kernels
    (``afm_core._mlx.qmatmul``) small models run faster dequantized.  With them
    the quantized weights are kept: the default model (Q4_1) then decodes
    3-11x faster than in float32 (``benchmarks/qmatmul.py``; the range is a
    loaded 2-core machine) with the same perplexity on 1024 tokens (29.4104
    vs 29.4107) and the same 64 greedy tokens on 4 prompts.  On Metal, and for
    models whose float32 weights would exceed 4 GB, they are kept too.
    """
    import mlx.core as mx

    from ..._mlx.qmatmul import qmm_available

    if mx.metal.is_available() or qmm_available():
        return False
    return n_params <= AUTO_DEQUANTIZE_MAX_PARAMS

_LAYER_NAMES = {
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
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TENSOR_RE = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_0-9]+)\.(weight|bias)$")
# Tensors llama.cpp writes that the mlx-lm model recomputes or does not use.
_IGNORED = {"rope_freqs.weight"}


def _mlx_name(name: str) -> tuple[str, str]:
    """(mlx-lm module path, 'weight'|'bias') for a GGUF tensor name."""
    m = _TENSOR_RE.match(name)
    if m is None:
        raise GGUFError(f"unsupported GGUF tensor {name!r} for a llama model")
    layer, base, kind = m.groups()
    if layer is None and base in _TOP_NAMES:
        return _TOP_NAMES[base], kind
    if layer is not None and base in _LAYER_NAMES:
        return f"model.layers.{layer}.{_LAYER_NAMES[base]}", kind
    if base.endswith("_exps") or base.endswith("_inp"):
        raise GGUFError(f"unsupported GGUF tensor {name!r}: mixture-of-experts llama is not supported")
    raise GGUFError(f"unsupported GGUF tensor {name!r} for a llama model")


def _f32(value: Any) -> float:
    """A GGUF float32 scalar as the shortest float that round-trips."""
    return float(str(np.float32(value)))


def _get_int(info: GGUFInfo, key: str, default: int | None = None) -> int:
    value = info.get(key, default)
    if value is None:
        raise GGUFError(f"{info.path}: missing GGUF metadata key {key!r}")
    if isinstance(value, np.ndarray):
        if value.size == 0 or not np.all(value == value.flat[0]):
            raise GGUFError(f"{info.path}: per-layer {key} values are not supported")
        value = value.flat[0]
    return int(value)


def build_config(info: GGUFInfo) -> dict[str, Any]:
    """The mlx-lm ``config.json`` for a llama GGUF (without quantization)."""
    arch = info.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{info.path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    p = f"{arch}."
    hidden = _get_int(info, p + "embedding_length")
    heads = _get_int(info, p + "attention.head_count")
    kv_heads = _get_int(info, p + "attention.head_count_kv", heads)
    head_dim = _get_int(info, p + "attention.key_length", hidden // heads)
    if _get_int(info, p + "attention.value_length", head_dim) != head_dim:
        raise GGUFError(f"{info.path}: different key and value head sizes are not supported")
    rope_dim = _get_int(info, p + "rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise GGUFError(f"{info.path}: partial rotary embeddings ({rope_dim} of {head_dim}) are not supported")
    if info.get(p + "expert_count"):
        raise GGUFError(f"{info.path}: mixture-of-experts llama ({p}expert_count) is not supported")
    tokens = info.get("tokenizer.ggml.tokens")
    embd = next((t for t in info.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFError(f"{info.path}: no token_embd.weight tensor")
    vocab = _get_int(info, p + "vocab_size", len(tokens) if tokens is not None else embd.shape[0])
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": _get_int(info, p + "block_count"),
        "intermediate_size": _get_int(info, p + "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(info.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": vocab,
        "rope_theta": _f32(info.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": _get_int(info, p + "context_length", 4096),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in info.tensors),
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in info.tensors),
        "mlp_bias": any(t.name.endswith("ffn_up.bias") for t in info.tensors),
    }
    config["rope_scaling"] = _rope_scaling(info, p)
    for key in ("bos", "eos"):
        tid = info.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            config[f"{key}_token_id"] = int(tid)
    return config


def llama3_rope_factors(
    head_dim: int, base: float, factor: float, low: float, high: float, old_context: int
) -> np.ndarray:
    """Per-frequency RoPE factors as llama.cpp's converter writes ``rope_freqs``."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_context / high, 1.0, np.where(wavelen > old_context / low, factor, mid))


def _rope_scaling(info: GGUFInfo, p: str) -> dict[str, Any] | None:
    kind = info.get(p + "rope.scaling.type", "none")
    rope_freqs = next((t for t in info.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        return _llama3_scaling(info, p, rope_freqs)
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": _f32(info.get(p + "rope.scaling.factor", 1.0))}
    raise GGUFError(f"{info.path}: unsupported RoPE scaling type {kind!r} (supported: none, linear)")


def _llama3_scaling(info: GGUFInfo, p: str, t: TensorInfo) -> dict[str, Any]:
    """Recover llama 3.1-style ``rope_scaling`` from the ``rope_freqs`` tensor.

    GGUF stores only the resulting factors; the usual parameters
    (low/high frequency factors 1 and 4, original context 8192) are checked
    against them, so an unknown variant fails instead of running wrong.
    """
    if t.type_name != "F32":
        raise GGUFError(f"{info.path}: rope_freqs.weight of type {t.type_name} is not supported")
    n = int(np.prod(t.shape))
    raw = np.fromfile(info.path, dtype="<f4", count=n, offset=info.data_offset + t.offset)
    if raw.size != n:
        raise GGUFError(f"{info.path}: truncated rope_freqs.weight")
    factors = raw.astype(np.float64)
    heads = _get_int(info, p + "attention.head_count")
    head_dim = _get_int(info, p + "attention.key_length", _get_int(info, p + "embedding_length") // heads)
    base = float(info.get(p + "rope.freq_base", 10000.0))
    factor = float(factors.max())
    for low, high, old in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384), (1.0, 2.0, 8192)):
        ref = llama3_rope_factors(head_dim, base, factor, low, high, old)
        if ref.shape == factors.shape and np.allclose(ref, factors, rtol=1e-4, atol=1e-6):
            return {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": old}  # fmt: skip
    raise GGUFError(
        f"{info.path}: per-frequency RoPE factors (rope_freqs.weight) that match no known "
        "llama 3 rope_scaling are not supported"
    )


def check_tensor_types(info: GGUFInfo) -> None:
    """Raise :class:`GGUFError` naming every unsupported tensor type."""
    bad = Counter(t.type_name for t in info.tensors if t.type_name not in SUPPORTED_TYPES)
    if bad:
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(bad.items()))
        raise GGUFError(
            f"{info.path}: unsupported GGUF tensor type(s) {kinds}; supported: "
            f"{', '.join(SUPPORTED_TYPES)}. Re-quantize the model with one of those."
        )
    for t in info.tensors:
        if t.type_name in _QUANT_BITS and t.shape[-1] % _GROUP_SIZE:
            raise GGUFError(f"{info.path}: {t.name} row length {t.shape[-1]} is not a multiple of 32")


def _unpermute(x: Any, n_head: int) -> Any:
    """Undo llama.cpp's ``permute`` on the rows of ``x`` (any MLX array)."""
    rows = x.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot undo the Q/K permutation: {rows} rows for {n_head} heads")
    rest = tuple(x.shape[1:])
    return x.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def convert_weights(
    info: GGUFInfo,
    config: dict[str, Any],
    *,
    dequantize: bool = False,
    dtype: str = "float32",
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(mlx-lm weights, quantization config or None) from a GGUF file's tensors."""
    import mlx.core as mx

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, not {dtype!r}")
    target = getattr(mx, dtype)
    try:
        raw = mx.load(info.path)
    except Exception as exc:  # MLX raises RuntimeError/ValueError from C++
        raise GGUFError(f"{info.path}: MLX could not read the GGUF tensors: {exc}") from exc
    assert isinstance(raw, dict)
    out: dict[str, Any] = {}
    bits_of: dict[str, int] = {}
    heads = {"self_attn.q_proj": config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"]}  # fmt: skip
    for t in info.tensors:
        if t.name in _IGNORED:
            continue
        module, kind = _mlx_name(t.name)
        n_head = next((n for suffix, n in heads.items() if module.endswith(suffix)), None)
        parts = _tensor_parts(raw, t)
        if n_head is not None:
            parts = {k: _unpermute(v, n_head) for k, v in parts.items()}
        if "scales" in parts:
            bits = _QUANT_BITS[t.type_name]
            scales = parts["scales"].astype(target)
            biases = parts["biases"].astype(target)
            if dequantize:
                w = mx.dequantize(parts["weight"], scales, biases, group_size=_GROUP_SIZE, bits=bits)
                out[f"{module}.{kind}"] = w.astype(target)
            else:
                out[f"{module}.weight"] = parts["weight"]
                out[f"{module}.scales"] = scales
                out[f"{module}.biases"] = biases
                bits_of[module] = bits
        else:
            out[f"{module}.{kind}"] = parts["weight"].astype(target)
        mx.eval(*(out[k] for k in out if k.startswith(module + ".")))
    if "model.embed_tokens.weight" not in out:
        raise GGUFError(f"{info.path}: no token_embd.weight tensor")
    if not bits_of:
        return out, None
    default_bits = Counter(bits_of.values()).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": _GROUP_SIZE, "bits": default_bits, "mode": "affine"}
    for module, bits in sorted(bits_of.items()):
        if bits != default_bits:
            quant[module] = {"group_size": _GROUP_SIZE, "bits": bits, "mode": "affine"}
    return out, quant


def _tensor_parts(raw: dict[str, Any], t: TensorInfo) -> dict[str, Any]:
    """The MLX arrays for GGUF tensor ``t``: weight (+ scales, biases)."""
    base = t.name[: -len(".weight")] if t.name.endswith(".weight") else None
    if t.type_name in _QUANT_BITS:
        if base is None or f"{base}.scales" not in raw:
            raise GGUFError(f"{t.name}: quantized tensor without MLX scales (unexpected MLX loader)")
        parts = {"weight": raw[t.name], "scales": raw[f"{base}.scales"], "biases": raw[f"{base}.biases"]}
    else:
        parts = {"weight": raw[t.name]}
    return parts


def convert_gguf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    dequantize: bool = False,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: Progress | None = None,
    quantize: int | None = None,
) -> Path:
    """Convert the GGUF file ``src`` into the mlx-lm directory ``dst``.

    ``dtype`` is the float type of weights, norms and quantization
    scales/biases (activations follow it).  With ``dequantize`` the Q4/Q8
    tensors are written as ``dtype`` weights instead of MLX quantized ones.
    The directory appears atomically; an existing non-empty ``dst`` is an
    error unless ``overwrite``.  Returns ``dst``.
    """
    say = progress or (lambda _msg: None)
    src_path, dst_path = Path(src), Path(dst)
    info = read_gguf_info(src_path)
    config = build_config(info)
    check_tensor_types(info)
    types = Counter(t.type_name for t in info.tensors)
    say(
        f"converting {src_path.name}: llama, {config['num_hidden_layers']} layers, "
        f"hidden {config['hidden_size']}, tensors {dict(sorted(types.items()))}"
    )
    tok_files = build_tokenizer_files(info.metadata)
    weights, quant = convert_weights(info, config, dequantize=dequantize or quantize is not None,
                                     dtype=dtype)
    if quantize is not None:
        weights, quant = requantize(weights, quantize)
    config["torch_dtype"] = dtype
    if quant is not None:
        config["quantization"] = quant
        config["quantization_config"] = quant
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}

    if dst_path.exists() and not overwrite and any(dst_path.iterdir()):
        raise ModelLoadError(f"output directory {dst_path} exists and is not empty")
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst_path.name}.", suffix=".partial", dir=dst_path.parent))
    try:
        import mlx.core as mx

        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        say(f"writing {len(weights)} tensors ({'dequantized ' if quant is None else ''}{dtype})")
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", gen)
        for name, doc in tok_files.items():
            _write_json(tmp / name, doc)
        _install(tmp, dst_path, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"wrote {dst_path}")
    return dst_path


REQUANTIZE_GROUP_SIZE = 32
"""Group of ``convert-gguf --quantize``: GGUF's Q4/Q8 block, the layout afm's
CPU kernels were measured on (8 bits: perplexity 29.44 against float32's 29.41
on the default model; 4 bits kept from Q4_1: 29.41)."""


def requantize(weights: dict[str, Any], bits: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Quantize every 2-D float ``*.weight`` (linear layers, embeddings) to
    MLX's affine layout at ``bits`` (4 or 8), group :data:`REQUANTIZE_GROUP_SIZE`;
    returns the weights and the quantization config."""
    import mlx.core as mx

    if bits not in (4, 8):
        raise GGUFError(f"--quantize takes 4 or 8 bits, not {bits}")
    group = REQUANTIZE_GROUP_SIZE
    out: dict[str, Any] = {}
    for name, w in weights.items():
        if (name.endswith(".weight") and w.ndim == 2 and w.shape[-1] % group == 0
                and mx.issubdtype(w.dtype, mx.floating)):
            base = name[: -len(".weight")]
            q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
            out[name], out[base + ".scales"], out[base + ".biases"] = (
                q, scales.astype(w.dtype), biases.astype(w.dtype))
        else:
            out[name] = w
    return out, {"group_size": group, "bits": bits, "mode": "affine"}


def remove_partials(dst: str | os.PathLike[str]) -> None:
    """Delete leftovers of killed conversions into ``dst`` (call under a lock)."""
    dst = Path(dst)
    for p in dst.parent.glob(f".{dst.name}.*.partial"):
        shutil.rmtree(p, ignore_errors=True)


def _write_json(path: Path, doc: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _install(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``dst``, replacing an empty (or, if allowed, any) ``dst``."""
    if dst.exists() and overwrite and any(dst.iterdir()):
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
        return
    if dst.exists():
        dst.rmdir()  # empty by the check above
    os.rename(tmp, dst)
