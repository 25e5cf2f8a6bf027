"""GGML quantized blocks onto MLX's affine layout, in numpy.

MLX stores a quantized matrix as ``w = scale * q + bias`` per group of 32
(or 64, 128) values along a row, ``q`` an unsigned ``bits``-wide code packed
little-endian into ``uint32`` words (value ``i`` of a row at bit
``i * bits`` of the row's bit stream).  Each GGML type below is decoded into
that triplet: its integer codes, and per 32-value group one scale and one
bias computed in float32.

Exact (every weight is what llama.cpp's dequantization gives, bit for bit in
float32; ``tests/models/test_gguf_quants.py`` checks each against
``gguf.quants.dequantize``):

=========  ====  =================================================
GGML type  bits  group of 32: scale, bias
=========  ====  =================================================
Q4_0       4     ``d``, ``-8 d``
Q4_1       4     ``d``, ``m``
Q5_0       5     ``d``, ``-16 d``
Q5_1       5     ``d``, ``m``
Q8_0       8     ``d``, ``-128 d`` (codes ``q + 128``)
Q4_K       4     ``d * sc_j``, ``-dmin * m_j`` (sub-block ``j`` of 8)
Q5_K       5     same as Q4_K
IQ4_NL     8     ``d``, ``-128 d``; codes ``kvalues[q] + 128``
IQ4_XS     8     ``d * (ls_j - 32)``, ``-128`` times that
=========  ====  =================================================

IQ4_NL/IQ4_XS use a non-uniform 16-entry codebook: the only affine layout
that holds it exactly is 8 bits (the entries are integers in [-127, 113]).

Re-laid out (GGML groups of 16 have no MLX equivalent: MLX groups are 32,
64 or 128 wide).  Each 32-group joins two 16-wide sub-blocks with their own
scale; the result keeps the sub-block with the larger scale *exact* and
rounds the other onto that grid (at most half a step of the finer grid it
gets, see :func:`_join_symmetric`):

* Q6_K (``d * sc * (q - 32)``, 6-bit codes, int8 ``sc`` per 16): 8 bits by
  default (the coarse sub-block's codes times 4, so the other one rounds to
  a quarter of the coarse step), or 6 bits (``q6k_bits=6``: the other one
  rounds to the coarse step itself);
* Q3_K (``d * (sc - 32) * q``, 3-bit signed codes): 4 bits (codes times 2);
* Q2_K (``d * sc * q - dmin * m``, 2-bit codes, different minimums per 16):
  4 bits, from the 32 exact values' minimum and maximum.

``benchmarks/gguf_quality.py`` measures what these cost in perplexity
(docs/models.md has the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..._errors import GGUFError

__all__ = [
    "EXACT_TYPES",
    "FLOAT_TYPES",
    "GROUP_SIZE",
    "RELAID_TYPES",
    "MLXQuant",
    "pack",
    "to_mlx",
    "unpack",
]

GROUP_SIZE = 32
EXACT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS")
RELAID_TYPES = ("Q2_K", "Q3_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")

# llama.cpp's kvalues_iq4nl (ggml-common.h).
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      dtype=np.int16)  # fmt: skip


@dataclass(frozen=True, slots=True)
class MLXQuant:
    """One tensor in MLX's affine layout (float32 scales and biases)."""

    weight: np.ndarray  # uint32, (rows, cols * bits / 32)
    scales: np.ndarray  # float32, (rows, cols / 32)
    biases: np.ndarray  # float32, (rows, cols / 32)
    bits: int
    exact: bool  # whether it holds exactly llama.cpp's dequantized values


# --- packing --------------------------------------------------------------------


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ``bits``-wide codes (uint8, rows of a multiple of 32)
    into MLX's uint32 words, little-endian bit stream per row."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    rows, cols = codes.shape[0], codes.shape[-1]
    lead = codes.shape[:-1]
    if cols % 32:
        raise GGUFError(f"cannot pack rows of {cols} values (not a multiple of 32)")
    if bits == 8:
        out = codes
    elif bits in (2, 4):
        per = 8 // bits
        c = codes.reshape(*lead, cols // per, per)
        out = np.zeros(c.shape[:-1], np.uint8)
        for i in range(per):
            out |= c[..., i] << (bits * i)
    elif bits in (3, 5, 6):
        c = codes.reshape(*lead, cols // 8, 8).astype(np.uint64)
        acc = np.zeros(c.shape[:-1], np.uint64)
        for i in range(8):
            acc |= c[..., i] << np.uint64(bits * i)
        out = acc[..., None].view(np.uint8)[..., :bits].reshape(*lead, cols * bits // 8)
    else:
        raise GGUFError(f"MLX has no {bits}-bit affine layout")
    del rows
    return np.ascontiguousarray(out).view(np.uint32)


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack` (uint32 words -> uint8 codes)."""
    b = np.ascontiguousarray(words).view(np.uint8)
    bitstream = np.unpackbits(b, axis=-1, bitorder="little")
    lead = bitstream.shape[:-1]
    groups = bitstream.reshape(*lead, -1, bits).astype(np.uint8)
    weights = (1 << np.arange(bits)).astype(np.uint8)
    return (groups * weights).sum(axis=-1).astype(np.uint8)


# --- block fields ---------------------------------------------------------------


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte ``at`` of each block, as float32 (n, 1)."""
    return blocks[:, at : at + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """llama.cpp's 32-value nibble layout: low nibbles are values 0..15, high
    nibbles 16..31 of each run of 16 bytes."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k4_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit scales and mins from their 12 bytes (n, 8) each."""
    sc = sc.astype(np.uint8)
    lo, hi = sc[:, :4], sc[:, 4:8]
    mid = sc[:, 8:12]
    scales = np.concatenate([lo & 63, (mid & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([hi & 63, (mid >> 4) | ((hi >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


# --- exact types: (codes (n, 32 * groups), scales (n, groups), biases) ----------------


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, -8 * d


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Bit ``i`` of the little-endian bit field ``qh`` for i < n, as uint8 (rows, n)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[:, :n]


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6], 32) << 4), d, -16 * d


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    codes = _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8], 32) << 4)
    return codes, _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128 * d


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 256 low-nibble codes: per 32 bytes, 32 low then 32 high nibbles."""
    q = qs.reshape(-1, 4, 32)
    return np.stack([q & 0x0F, q >> 4], axis=2).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k4_scales(b[:, 4:16])
    return _k_nibbles(b[:, 16:144]), d * sc, -(dmin * m)


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k4_scales(b[:, 4:16])
    # qh[l] bit j is the fifth bit of value 32 j + l
    high = np.unpackbits(b[:, 16:48][:, :, None], axis=-1, bitorder="little")  # (n, 32, 8)
    high = high.transpose(0, 2, 1).reshape(-1, 256)
    return _k_nibbles(b[:, 48:176]) | (high << 4), d * sc, -(dmin * m)


def _iq4_nl(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    codes = (IQ4_VALUES[_nibbles(b[:, 2:18])] + 128).astype(np.uint8)
    return codes, d, -128 * d


def _iq4_xs(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    scales_h = b[:, 2:4].copy().view("<u2").astype(np.uint32)  # (n, 1)
    scales_l = b[:, 4:8]
    ib = np.arange(8)
    low = (scales_l[:, ib // 2] >> (4 * (ib % 2))) & 0x0F
    ls = low.astype(np.int32) | (((scales_h >> (2 * ib)) & 3).astype(np.int32) << 4)
    dl = d * (ls - 32).astype(np.float32)
    qs = b[:, 8:136].reshape(-1, 8, 16)
    codes = (IQ4_VALUES[_nibbles(qs)] + 128).astype(np.uint8).reshape(-1, 256)
    return codes, dl, -128 * dl


_EXACT = {
    "Q4_0": (_q4_0, 4), "Q4_1": (_q4_1, 4), "Q5_0": (_q5_0, 5), "Q5_1": (_q5_1, 5),
    "Q8_0": (_q8_0, 8), "Q4_K": (_q4_k, 4), "Q5_K": (_q5_k, 5), "IQ4_NL": (_iq4_nl, 8),
    "IQ4_XS": (_iq4_xs, 8),
}  # fmt: skip


# --- 16-wide sub-blocks: (sub-scales (n, 16), centred codes (n, 256)) -----------------


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # (n, half, run of 32 bytes, l)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # j = 0..3 within a half
    shifts = (2 * np.arange(4)).reshape(1, 1, 4, 1).astype(np.uint8)
    high = (qh >> shifts) & 3
    codes = (low | (high << 4)).astype(np.int16) - 32
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    return _f16(b, 208) * sc, codes.reshape(-1, 256)


def _q3_k_scales(raw: np.ndarray) -> np.ndarray:
    """Q3_K's sixteen 6-bit scales (minus 32) from their 12 bytes."""
    i = np.arange(16)
    low = (raw[:, i % 8] >> (4 * (i // 8))) & 0x0F
    high = (raw[:, 8 + i % 4] >> (2 * (i // 4))) & 3
    return (low | (high << 4)).astype(np.float32) - 32


def _q3_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hmask = b[:, 0:32].reshape(-1, 1, 1, 32)
    qs = b[:, 32:96].reshape(-1, 2, 1, 32)  # (n, half, 1, l)
    j = np.arange(4).reshape(1, 1, 4, 1).astype(np.uint8)
    low = (qs >> (2 * j)) & 3  # (n, half, j, l)
    bit = (np.arange(2).reshape(1, 2, 1, 1) * 4 + j).astype(np.uint8)
    has_high = (hmask >> bit) & 1
    codes = low.astype(np.int16) - 4 * (1 - has_high.astype(np.int16))
    return _f16(b, 108) * _q3_k_scales(b[:, 96:108]), codes.reshape(-1, 256)


def _q2_k_values(b: np.ndarray) -> np.ndarray:
    """Q2_K's 256 values per block (float32), as llama.cpp computes them."""
    sc = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    qs = b[:, 16:80].reshape(-1, 2, 1, 32)
    j = np.arange(4).reshape(1, 1, 4, 1).astype(np.uint8)
    q = ((qs >> (2 * j)) & 3).astype(np.float32).reshape(-1, 16, 16)
    scale = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    minimum = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    return (scale * q - minimum).reshape(-1, 256)


_SUB16 = {"Q6_K": (_q6_k, 6), "Q3_K": (_q3_k, 3)}


def _join_symmetric(sub: np.ndarray, codes: np.ndarray, src_bits: int, bits: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Two 16-wide sub-blocks ``s * c`` (``c`` in [-2^(b-1), 2^(b-1))) per
    32-group, on a ``bits``-bit grid of step ``s_big / 2^(bits - b)``: the
    sub-block with the larger ``|s|`` is exact, the other rounds to the
    nearest step (clipped at the grid's ends).  Returns (codes, scales,
    biases, exact)."""
    k = float(1 << (bits - src_bits))
    zero = 1 << (bits - 1)
    pairs = sub.reshape(-1, 2)  # (groups, 2)
    c = codes.reshape(-1, 2, 16).astype(np.float32)
    big = np.where(np.abs(pairs[:, 0]) >= np.abs(pairs[:, 1]), pairs[:, 0], pairs[:, 1])
    safe = np.where(big == 0, 1, big)
    ratio = np.where(big[:, None] == 0, 0, pairs / safe[:, None]) * k  # k exactly for the big one
    q = np.clip(np.rint(c * ratio[:, :, None]) + zero, 0, (1 << bits) - 1)
    scale = big / np.float32(k)
    exact = bool(np.all(q == c * ratio[:, :, None] + zero))
    return q.astype(np.uint8).reshape(codes.shape), scale.astype(np.float32), \
        (-zero * scale).astype(np.float32), exact


def _minmax(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups of 32 float values onto ``bits`` bits from their range."""
    v = values.reshape(-1, GROUP_SIZE)
    lo, hi = v.min(axis=1), v.max(axis=1)
    top = (1 << bits) - 1
    scale = (hi - lo) / np.float32(top)
    safe = np.where(scale == 0, 1, scale)
    q = np.clip(np.rint((v - lo[:, None]) / safe[:, None]), 0, top)
    return q.astype(np.uint8).reshape(values.shape), scale.astype(np.float32), lo.astype(np.float32)


# --- entry point ------------------------------------------------------------------------


def _groups(x: np.ndarray, rows: int) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).reshape(rows, -1)


def to_mlx(blocks: np.ndarray, type_name: str, shape: tuple[int, ...], *, q6k_bits: int = 8,
           rows_per_chunk: int = 8192) -> MLXQuant:
    """GGML blocks (``(n_blocks, block_bytes)`` uint8) of a tensor of numpy
    ``shape`` as an :class:`MLXQuant` (groups of 32 along the last axis; the
    leading axes are flattened into rows)."""
    cols = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    if cols % GROUP_SIZE:
        raise GGUFError(f"rows of {cols} values are not a multiple of {GROUP_SIZE}")
    per_row = blocks.shape[0] // rows
    parts: list[MLXQuant] = []
    step = max(1, rows_per_chunk)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        parts.append(_convert(np.asarray(blocks[r0 * per_row : r1 * per_row]), type_name,
                              r1 - r0, q6k_bits))
    return MLXQuant(
        weight=np.concatenate([p.weight for p in parts]),
        scales=np.concatenate([p.scales for p in parts]),
        biases=np.concatenate([p.biases for p in parts]),
        bits=parts[0].bits,
        exact=all(p.exact for p in parts),
    )


def _convert(b: np.ndarray, type_name: str, rows: int, q6k_bits: int) -> MLXQuant:
    if type_name in _EXACT:
        fn, bits = _EXACT[type_name]
        codes, scales, biases = fn(b)
        exact = True
    elif type_name in _SUB16:
        fn16, src_bits = _SUB16[type_name]
        bits = q6k_bits if type_name == "Q6_K" else 4
        if type_name == "Q6_K" and bits not in (6, 8):
            raise GGUFError(f"Q6_K converts to 6 or 8 bits, not {bits}")
        sub, centred = fn16(b)
        codes, scales, biases, exact = _join_symmetric(sub, centred, src_bits, bits)
    elif type_name == "Q2_K":
        bits = 4
        codes, scales, biases = _minmax(_q2_k_values(b), bits)
        exact = False
    else:
        raise GGUFError(f"GGML type {type_name} has no MLX layout here")
    codes = codes.reshape(rows, -1)
    return MLXQuant(pack(codes, bits), _groups(scales, rows), _groups(biases, rows), bits, exact)
