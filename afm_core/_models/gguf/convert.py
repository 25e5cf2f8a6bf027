"""Convert GGUF files into mlx-lm model directories.

``convert_gguf(src, dst)`` writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files of
:mod:`afm_core._models.gguf.tokenizer` into ``dst`` atomically (a temporary
sibling directory renamed into place), so a killed conversion never leaves a
half-written model behind.

* Architectures: :mod:`afm_core._models.gguf.arch` (one module per family:
  names, config, row orders, float transforms).
* Quantized tensors: :mod:`afm_core._models.gguf.quants` puts each GGML type
  onto MLX's affine layout (groups of 32), exactly for Q4_0, Q4_1, Q5_0,
  Q5_1, Q8_0, Q4_K, Q5_K, IQ4_NL and IQ4_XS, re-laid out for the 16-wide
  groups of Q2_K, Q3_K and Q6_K.  Scales and biases are stored as
  ``scale_dtype`` (see :data:`DEFAULT_SCALE_DTYPE`).  ``dequantize=True``
  writes float weights instead (``gguf.quants.dequantize``: llama.cpp's own
  values).
* Float tensors (F32, F16, BF16) keep their values, stored as ``dtype``
  (float32 by default: MLX's fast CPU type; the cast is exact).
* K-quant blocks as they are: the Q4_K and Q6_K matrices of linear layers
  (rows a multiple of 256 values; not the embedding) are also written,
  byte for byte GGUF's blocks in the model's row order, to
  ``kquant.safetensors`` (:data:`KQUANT_FILE`), which mlx-lm does not read:
  afm's loader gives those layers to the CPU kernels that compute on the
  blocks themselves (``afm_core._mlx.kquant``), and the MLX layout beside
  them stays for Metal and for every other reader.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..._errors import GGUFError, ModelLoadError
from .arch import Architecture, Hparams, get_architecture
from .arch.llama import llama3_rope_factors
from .quants import EXACT_TYPES, FLOAT_TYPES, GROUP_SIZE, RELAID_TYPES, to_mlx
from .reader import GGUFInfo, TensorInfo, read_gguf_info, tensor_bytes
from .tokenizer import build_tokenizer_files

__all__ = [
    "CONVERTER_VERSION",
    "DEFAULT_SCALE_DTYPE",
    "KQUANT_FILE",
    "KQUANT_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TYPES",
    "auto_dequantize",
    "build_config",
    "convert_gguf",
    "llama3_rope_factors",
    "remove_partials",
]

#: Bumped whenever the output of the converter changes (cache keys use it).
CONVERTER_VERSION = 3
#: The K-quant blocks' file in a converted directory, and the types it holds.
KQUANT_FILE = "kquant.safetensors"
KQUANT_TYPES = ("Q4_K", "Q6_K")
_KQUANT_BLOCK = 256
SUPPORTED_ARCHITECTURES = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3", "qwen3moe")
SUPPORTED_TYPES = (*FLOAT_TYPES, *EXACT_TYPES, *RELAID_TYPES)
_DTYPES = ("float32", "float16", "bfloat16")
_GROUP_SIZE = GROUP_SIZE

#: Scales and biases of quantized linear layers.  float16 halves their bytes
#: (one bit per weight at groups of 32 instead of two: decode on the CPU reads
#: every byte once per token) for a perplexity change below 0.1% on the real
#: models (docs/models.md, "Converting GGUF files").  The embedding keeps
#: float32 scales whatever this says (see ``_Writer.add_quant``).
DEFAULT_SCALE_DTYPE = "float16"

#: Largest model auto-dequantized on CPU (1e9 parameters = 4 GB of float32).
AUTO_DEQUANTIZE_MAX_PARAMS = 1_000_000_000

Progress = Callable[[str], None]


def count_parameters(info: GGUFInfo) -> int:
    """Number of weights in a GGUF file (all tensors)."""
    return sum(int(np.prod(t.shape)) for t in info.tensors)


def auto_dequantize(n_params: int) -> bool:
    """Whether quantized weights should be dequantized to float32 by default.

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


def build_config(info: GGUFInfo) -> dict[str, Any]:
    """The mlx-lm ``config.json`` for a GGUF file (without quantization)."""
    arch = get_architecture(info.architecture, info.path)
    return arch.config(Hparams(info, arch.gguf_name))


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
        t.n_bytes  # noqa: B018 - raises for a row length the type's block does not divide


def _float_values(info: GGUFInfo, t: TensorInfo) -> np.ndarray:
    """A float or quantized tensor's values as float32 (llama.cpp's own)."""
    raw = tensor_bytes(info, t)
    if t.type_name in ("F32", "F16"):
        return np.asarray(raw, dtype=np.float32)
    if t.type_name == "BF16":
        bits = np.asarray(raw).reshape(-1).view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(t.shape)
    import gguf

    rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
    qtype = gguf.GGMLQuantizationType(t.ggml_type)
    values = gguf.quants.dequantize(np.asarray(raw).reshape(rows, -1), qtype)
    return values.reshape(t.shape).astype(np.float32, copy=False)


class _Writer:
    """Accumulates the converted tensors (MLX arrays) and their bit widths."""

    def __init__(self, dtype: str, scale_dtype: str) -> None:
        import mlx.core as mx

        self.mx = mx
        self.dtype = getattr(mx, dtype)
        self.scale_dtype = getattr(mx, scale_dtype)
        self.out: dict[str, Any] = {}
        self.bits: dict[str, int] = {}
        self.relaid: Counter[str] = Counter()
        self.kquant: dict[str, Any] = {}  # module.weight: GGUF's blocks (uint8 rows)
        self.kquant_types: dict[str, str] = {}  # module: its type

    def add_kquant(self, module: str, t: TensorInfo, blocks: np.ndarray, order: np.ndarray | None) -> None:
        """Keep a linear layer's Q4_K / Q6_K blocks as they are, one uint8 row
        per output row (rows are independent: the row order applies as is)."""
        rows = int(np.prod(t.shape[:-1]))
        data = np.asarray(blocks).reshape(rows, -1)
        if order is not None:
            data = data[order]
        self.kquant[f"{module}.weight"] = self.mx.array(np.ascontiguousarray(data))
        self.kquant_types[module] = t.type_name

    def add_float(self, name: str, value: np.ndarray) -> None:
        self.out[name] = self.mx.array(np.ascontiguousarray(value)).astype(self.dtype)
        self.mx.eval(self.out[name])

    def add_quant(self, module: str, t: TensorInfo, q: Any, order: np.ndarray | None) -> None:
        mx = self.mx
        # The embedding's lookup dequantizes in its scales' type, and the
        # hidden states start in that type: float32 there keeps them float32
        # as llama.cpp's are (float16 made Gemma 3's whole residual stream
        # float16: +1.3% perplexity).
        scale_dtype = mx.float32 if module.endswith("embed_tokens") else self.scale_dtype
        parts = {"weight": q.weight, "scales": q.scales, "biases": q.biases}
        if order is not None:
            if order.shape[0] != q.weight.shape[0]:
                raise GGUFError(f"{t.name}: {q.weight.shape[0]} rows, expected {order.shape[0]}")
            parts = {k: v[order] for k, v in parts.items()}
        lead = tuple(t.shape[:-1])
        for key, value in parts.items():
            arr = mx.array(np.ascontiguousarray(value).reshape(*lead, -1))
            self.out[f"{module}.{key}"] = arr if key == "weight" else arr.astype(scale_dtype)
        mx.eval(*(self.out[f"{module}.{k}"] for k in parts))
        self.bits[module] = q.bits
        if not q.exact:
            self.relaid[t.type_name] += 1

    def quantization(self) -> dict[str, Any] | None:
        if not self.bits:
            return None
        default = Counter(self.bits.values()).most_common(1)[0][0]
        quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
        for module, bits in sorted(self.bits.items()):
            if bits != default:
                quant[module] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"}
        return quant


def convert_weights(
    info: GGUFInfo,
    config: dict[str, Any],
    *,
    dequantize: bool = False,
    dtype: str = "float32",
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    q6k_bits: int = 8,
    arch: Architecture | None = None,
    kquant: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(mlx-lm weights, quantization config or None) from a GGUF file's tensors.
    With ``kquant`` (a dict), the linear layers' Q4_K and Q6_K blocks also
    go into it as they are (``module.weight``: uint8 rows), and their types
    into ``kquant["__types__"]`` (module: type name)."""
    if dtype not in _DTYPES or scale_dtype not in _DTYPES:
        raise ValueError(f"dtype and scale_dtype must be one of {_DTYPES}")
    arch = arch or get_architecture(info.architecture, info.path)
    w = _Writer(dtype, scale_dtype)
    for t in info.tensors:
        name = arch.map_name(t.name)
        if name is None:
            continue
        order = arch.row_order(name, config)
        quantized = t.type_name not in FLOAT_TYPES
        if quantized and not dequantize and len(t.shape) >= 2 and name.endswith(".weight"):
            module = name[: -len(".weight")]
            blocks = tensor_bytes(info, t)
            q = to_mlx(blocks, t.type_name, t.shape, q6k_bits=q6k_bits)
            w.add_quant(module, t, q, order)
            if (kquant is not None and t.type_name in KQUANT_TYPES and len(t.shape) == 2
                    and t.shape[-1] % _KQUANT_BLOCK == 0 and not module.endswith("embed_tokens")):
                w.add_kquant(module, t, blocks, order)
            continue
        value = arch.transform_float(name, _float_values(info, t))
        if order is not None:
            if value.shape[0] != order.shape[0]:
                raise GGUFError(f"{t.name}: {value.shape[0]} rows, expected {order.shape[0]}")
            value = value[order]
        w.add_float(name, value)
    if "model.embed_tokens.weight" not in w.out:
        raise GGUFError(f"{info.path}: no token_embd.weight tensor")
    if kquant is not None:
        kquant.update(w.kquant)
        kquant["__types__"] = w.kquant_types
    return w.out, w.quantization()


def convert_gguf(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    dequantize: bool = False,
    dtype: str = "float32",
    overwrite: bool = False,
    progress: Progress | None = None,
    quantize: int | None = None,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    q6k_bits: int = 8,
) -> Path:
    """Convert the GGUF file ``src`` into the mlx-lm directory ``dst``.

    ``dtype`` is the float type of float weights and norms (activations
    follow it); ``scale_dtype`` that of quantization scales and biases;
    ``q6k_bits`` the MLX bit width Q6_K tensors become (8, or 6: see
    :mod:`afm_core._models.gguf.quants`).  With ``dequantize`` quantized
    tensors are written as ``dtype`` weights instead of MLX quantized ones.
    The directory appears atomically; an existing non-empty ``dst`` is an
    error unless ``overwrite``.  Returns ``dst``.
    """
    say = progress or (lambda _msg: None)
    src_path, dst_path = Path(src), Path(dst)
    info = read_gguf_info(src_path)
    arch = get_architecture(info.architecture, info.path)
    config = arch.config(Hparams(info, arch.gguf_name))
    check_tensor_types(info)
    types = Counter(t.type_name for t in info.tensors)
    say(
        f"converting {src_path.name}: {arch.gguf_name} -> mlx-lm {arch.model_type}, "
        f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"tensors {dict(sorted(types.items()))}"
    )
    tok_files = build_tokenizer_files(info.metadata)
    kquant: dict[str, Any] = {}
    weights, quant = convert_weights(info, config, dequantize=dequantize or quantize is not None,
                                     dtype=dtype, scale_dtype=scale_dtype, q6k_bits=q6k_bits,
                                     arch=arch, kquant=kquant)
    kquant_types: dict[str, str] = kquant.pop("__types__", {})
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
        if kquant:
            say(f"writing the K-quant blocks of {len(kquant)} layers")
            mx.save_safetensors(str(tmp / KQUANT_FILE), kquant,
                                metadata={"format": "afm-kquant", **kquant_types})
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
