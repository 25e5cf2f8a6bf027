"""A minimal GGUF writer and llama.cpp's reference quantizers, for tests.

The reader's edge cases (alignment, old versions, truncation) and the llama
tests use it; the architecture and quant-type tests use ``gguf_build.py``
(the ``gguf`` package's own writer).

Independent of the importer under test: it follows the GGUF spec and
llama.cpp's ``ggml-quants.c`` reference code (``quantize_row_q4_0_ref`` and
friends), so a file written here is what llama.cpp's converter would write.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "BF16": 30}
QK = 32

# GGUF metadata value types
_U8, _I8, _U16, _I16, _U32, _I32, _F32, _BOOL, _STR, _ARR, _U64, _I64, _F64 = range(13)
_NP_TYPES = {np.dtype("uint8"): _U8, np.dtype("int8"): _I8, np.dtype("uint16"): _U16,
             np.dtype("int16"): _I16, np.dtype("uint32"): _U32, np.dtype("int32"): _I32,
             np.dtype("float32"): _F32, np.dtype("bool"): _BOOL, np.dtype("uint64"): _U64,
             np.dtype("int64"): _I64, np.dtype("float64"): _F64}  # fmt: skip


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v: Any) -> tuple[int, bytes]:
    if isinstance(v, bool):
        return _BOOL, struct.pack("<?", v)
    if isinstance(v, int):
        return (_U32, struct.pack("<I", v)) if 0 <= v < 2**32 else (_I64, struct.pack("<q", v))
    if isinstance(v, float):
        return _F32, struct.pack("<f", v)
    if isinstance(v, str):
        return _STR, _str(v)
    if isinstance(v, np.ndarray):
        et = _NP_TYPES[v.dtype]
        return _ARR, struct.pack("<IQ", et, v.size) + v.astype(v.dtype.newbyteorder("<")).tobytes()
    if isinstance(v, (list, tuple)):
        if all(isinstance(x, str) for x in v):
            return _ARR, struct.pack("<IQ", _STR, len(v)) + b"".join(_str(x) for x in v)
        raise TypeError("lists must hold strings; use numpy arrays for numbers")
    raise TypeError(f"cannot encode {type(v).__name__} as GGUF metadata")


# --- llama.cpp reference quantizers (ggml-quants.c) --------------------------


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    assert x.shape[-1] % QK == 0
    return x.reshape(-1, QK)


def quantize_q8_0(x: np.ndarray) -> bytes:
    b = _blocks(x)
    amax = np.abs(b).max(axis=1)
    d = amax / 127.0
    idn = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    v = b * idn[:, None]
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)  # roundf
    out = np.empty((b.shape[0], 34), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.tobytes()


def quantize_q4_0(x: np.ndarray) -> bytes:
    b = _blocks(x)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(b.shape[0]), idx]
    d = mx / -8.0
    idn = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, (b * idn[:, None] + 8.5).astype(np.int8)).astype(np.uint8)
    out = np.empty((b.shape[0], 18), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
    return out.tobytes()


def quantize_q4_1(x: np.ndarray) -> bytes:
    b = _blocks(x)
    lo, hi = b.min(axis=1), b.max(axis=1)
    d = (hi - lo) / 15.0
    idn = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.minimum(15, ((b - lo[:, None]) * idn[:, None] + 0.5).astype(np.int8)).astype(np.uint8)
    out = np.empty((b.shape[0], 20), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = lo.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 4:] = q[:, :16] | (q[:, 16:] << 4)
    return out.tobytes()


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (round to nearest even), as uint16."""
    u = np.asarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def dequantize(data: bytes, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Reference dequantization of ``encode(x, qtype)`` back to float32."""
    raw = np.frombuffer(data, np.uint8)
    if qtype == "F32":
        return raw.view(np.float32).reshape(shape).copy()
    if qtype == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if qtype == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[qtype]
    b = raw.reshape(-1, size)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    if qtype == "Q8_0":
        q = b[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(shape)
    qs = b[:, -16:]
    q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
    if qtype == "Q4_0":
        return (d * (q - 8)).reshape(shape)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * q + m).reshape(shape)


def encode(x: np.ndarray, qtype: str) -> bytes:
    """The GGUF data bytes of ``x`` as ``qtype``."""
    if qtype == "F32":
        return np.asarray(x, np.float32).tobytes()
    if qtype == "F16":
        return np.asarray(x, np.float32).astype(np.float16).tobytes()
    if qtype == "BF16":
        return to_bf16(x).tobytes()
    return {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0, "Q4_1": quantize_q4_1}[qtype](x)


def write_gguf(
    path: str | Path,
    metadata: dict[str, Any],
    tensors: Iterable[tuple[str, np.ndarray, str]],
    *,
    alignment: int = 32,
    version: int = 3,
) -> Path:
    """Write a GGUF file; ``tensors`` are (name, float array, GGML type name)."""
    path = Path(path)
    meta = dict(metadata)
    if alignment != 32:
        meta["general.alignment"] = alignment
    tensors = list(tensors)
    header = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(meta)))
    for k, v in meta.items():
        vt, vb = _value(v)
        header += _str(k) + struct.pack("<I", vt) + vb
    blobs = []
    offset = 0
    for name, arr, qtype in tensors:
        data = encode(arr, qtype)
        ne = list(reversed(np.asarray(arr).shape))
        header += _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        header += struct.pack("<IQ", TYPE_IDS[qtype], offset)
        pad = -len(data) % alignment
        blobs.append(data + bytes(pad))
        offset += len(data) + pad
    header += bytes(-len(header) % alignment)
    with open(path, "wb") as f:
        f.write(header)
        for blob in blobs:
            f.write(blob)
    return path


# --- exporting a tiny mlx-lm llama the way convert_hf_to_gguf.py does ---------


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF rotate-half -> interleaved rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def llama_tensors(
    weights: dict[str, np.ndarray], config: dict[str, Any], qtype: str, *, embed_type: str | None = None
) -> list[tuple[str, np.ndarray, str]]:
    """GGUF tensors for mlx-lm llama ``weights``: matrices as ``qtype``, norms F32."""
    out = []
    for name, w in weights.items():
        mod, kind = name.rsplit(".", 1)
        if mod == "model.embed_tokens":
            gname, t = "token_embd", embed_type or qtype
        elif mod == "model.norm":
            gname, t = "output_norm", "F32"
        elif mod == "lm_head":
            gname, t = "output", qtype
        else:
            _, _, layer, rest = mod.split(".", 3)
            gname = f"blk.{layer}.{_TO_GGUF[rest]}"
            t = "F32" if w.ndim == 1 else qtype
            if rest == "self_attn.q_proj":
                w = permute(w, config["num_attention_heads"])
            elif rest == "self_attn.k_proj":
                w = permute(w, config["num_key_value_heads"])
        out.append((f"{gname}.{kind}", w, t))
    return out


def llama_metadata(config: dict[str, Any], *, file_type: int = 0) -> dict[str, Any]:
    """The ``llama.*`` GGUF keys for an mlx-lm llama config."""
    return {
        "general.architecture": "llama",
        "general.name": "tiny-test-llama",
        "general.file_type": file_type,
        "llama.block_count": config["num_hidden_layers"],
        "llama.context_length": config.get("max_position_embeddings", 2048),
        "llama.embedding_length": config["hidden_size"],
        "llama.feed_forward_length": config["intermediate_size"],
        "llama.attention.head_count": config["num_attention_heads"],
        "llama.attention.head_count_kv": config["num_key_value_heads"],
        "llama.rope.freq_base": float(config.get("rope_theta", 10000.0)),
        "llama.rope.dimension_count": config["hidden_size"] // config["num_attention_heads"],
        "llama.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "llama.vocab_size": config["vocab_size"],
    }


def bpe_metadata(
    vocab: dict[str, int],
    merges: list[str],
    *,
    special: Iterable[str] = (),
    pre: str = "default",
    bos: str | None = None,
    eos: str | None = None,
    add_bos: bool = False,
    chat_template: str | None = None,
) -> dict[str, Any]:
    """``tokenizer.ggml.*`` keys of a byte-level BPE vocabulary."""
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = set(special)
    types = np.array([3 if t in special else 1 for t in tokens], np.int32)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": add_bos,
    }
    if bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = vocab[bos]
    if eos is not None:
        meta["tokenizer.ggml.eos_token_id"] = vocab[eos]
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta
