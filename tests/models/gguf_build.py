"""Tiny GGUF files for the converter's tests, written with the ``gguf``
package's own ``GGUFWriter`` (llama.cpp's gguf-py), so a file here is laid
out the way llama.cpp's converters lay it out.

Quantized tensors: the types ``gguf.quants`` can quantize (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, BF16) are quantized from float values; the others (K-quants,
IQ4) are random valid blocks whose float16 fields are scaled to a target
standard deviation.  Either way the tensor's meaning is what
``gguf.quants.dequantize`` says it is: the tests' oracle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

#: byte offsets of the float16 fields of each block (d, dmin, ...)
F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}  # fmt: skip
QUANTIZABLE = ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def random_blocks(name: str, shape: tuple[int, ...], rng: np.random.Generator,
                  std: float = 0.05) -> np.ndarray:
    """Random valid ``name`` blocks for a tensor of ``shape``, byte-shaped
    ``(*shape[:-1], bytes per row)``, whose values have about ``std``."""
    per, size = GGML_QUANT_SIZES[qtype(name)]
    rows = int(np.prod(shape[:-1]))
    n = rows * shape[-1] // per
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    fields = F16_FIELDS[name]
    ones = rng.uniform(0.5, 1.5, (n, len(fields)))

    def put(values: np.ndarray) -> None:
        for j, at in enumerate(fields):
            blocks[:, at : at + 2] = values[:, j].astype(np.float16).view(np.uint8).reshape(n, 2)

    put(ones)
    s0 = float(gguf.quants.dequantize(blocks.reshape(rows, -1), qtype(name)).std()) or 1.0
    put(ones * (std / s0))
    return blocks.reshape(*shape[:-1], -1)


def encode(values: np.ndarray | None, name: str, shape: tuple[int, ...], rng: np.random.Generator,
           std: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(data for ``GGUFWriter.add_tensor``, the float32 values it stands for)."""
    if values is None:
        values = (rng.standard_normal(shape) * std).astype(np.float32)
    if name == "F32":
        data = np.asarray(values, np.float32)
        return data, data
    if name == "F16":
        data = np.asarray(values, np.float32).astype(np.float16)
        return data, data.astype(np.float32)
    raw = (gguf.quants.quantize(np.asarray(values, np.float32), qtype(name)) if name in QUANTIZABLE
           else random_blocks(name, shape, rng, std))
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    deq = gguf.quants.dequantize(raw.reshape(rows, -1), qtype(name)).reshape(shape)
    return raw, deq.astype(np.float32)


def _add_value(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, np.ndarray):
        sub = {np.dtype(np.int32): GGUFValueType.INT32, np.dtype(np.float32): GGUFValueType.FLOAT32,
               np.dtype(np.uint32): GGUFValueType.UINT32}[value.dtype]
        w.add_key_value(key, value.tolist(), GGUFValueType.ARRAY, sub_type=sub)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"cannot write {type(value).__name__} metadata")


def write_gguf(path: str | Path, arch: str, metadata: dict[str, Any],
               tensors: list[tuple[str, np.ndarray, str]]) -> Path:
    """Write a GGUF file: ``tensors`` are (name, data from :func:`encode`, type)."""
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_architecture()
    for key, value in metadata.items():
        if key != "general.architecture":
            _add_value(w, key, value)
    for name, data, type_name in tensors:
        if type_name in ("F32", "F16"):
            w.add_tensor(name, np.ascontiguousarray(data))
        else:
            w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype(type_name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_vocab_metadata() -> dict[str, Any]:
    """A small byte-level BPE vocabulary (gpt2 style) with ChatML specials."""
    from tokenizers.pre_tokenizers import ByteLevel

    chars = sorted(ByteLevel.alphabet())
    tokens = [*chars, "Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = np.array([1] * (len(tokens) - 3) + [3, 3, 3], np.int32)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ t", "h e"],
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
        "tokenizer.ggml.bos_token_id": len(tokens) - 3,
        "tokenizer.ggml.add_bos_token": False,
    }
