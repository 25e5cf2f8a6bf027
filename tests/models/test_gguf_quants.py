"""Each GGML type on MLX's affine layout, against ``gguf.quants.dequantize``
(llama.cpp's own reference dequantization, from its gguf-py)."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest

from afm_core._models.gguf.quants import EXACT_TYPES, RELAID_TYPES, pack, to_mlx, unpack

from . import gguf_build as gb

SHAPE = (6, 512)


def _dequant(q: object) -> np.ndarray:
    return np.array(mx.dequantize(mx.array(q.weight), mx.array(q.scales), mx.array(q.biases),  # type: ignore[attr-defined]
                                  group_size=32, bits=q.bits))  # type: ignore[attr-defined]


def _blocks(name: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    raw = gb.random_blocks(name, SHAPE, rng)
    ref = gguf.quants.dequantize(raw, gb.qtype(name))
    return raw.reshape(-1, gguf.GGML_QUANT_SIZES[gb.qtype(name)][1]), ref


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mlx_layout(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (3, 128)).astype(np.uint8)
    words = pack(codes, bits)
    assert words.dtype == np.uint32 and words.shape == (3, 128 * bits // 32)
    ones, zeros = mx.ones((3, 4)), mx.zeros((3, 4))
    got = np.array(mx.dequantize(mx.array(words), ones, zeros, group_size=32, bits=bits))
    assert np.array_equal(got, codes)
    assert np.array_equal(unpack(words, bits), codes)
    w = mx.random.normal((3, 128))
    q, _, _ = mx.quantize(w, group_size=32, bits=bits)
    assert np.array_equal(pack(unpack(np.array(q), bits), bits), np.array(q))


@pytest.mark.parametrize("name", EXACT_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_types_dequantize_to_llama_cpp_values(name: str, seed: int) -> None:
    raw, ref = _blocks(name, seed)
    q = to_mlx(raw, name, SHAPE, rows_per_chunk=4)
    assert q.exact
    assert q.bits == {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q8_0": 8, "IQ4_NL": 8, "IQ4_XS": 8}.get(name, 4)
    assert q.weight.shape == (SHAPE[0], SHAPE[1] * q.bits // 32)
    assert np.array_equal(_dequant(q), ref)  # bit for bit, in float32


def test_quantizer_output_roundtrips_exactly() -> None:
    """Blocks from gguf's own quantizer (not random bytes) map exactly too."""
    x = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        raw = gguf.quants.quantize(x, gb.qtype(name))
        q = to_mlx(raw.reshape(-1, gguf.GGML_QUANT_SIZES[gb.qtype(name)][1]), name, SHAPE)
        assert np.array_equal(_dequant(q), gguf.quants.dequantize(raw, gb.qtype(name))), name


def _sub_scales(name: str, raw: np.ndarray) -> np.ndarray:
    """|scale| of each 16-wide sub-block, from the exact values' grid (the larger of a pair)."""
    from afm_core._models.gguf import quants

    sub, _ = quants._q6_k(raw) if name == "Q6_K" else quants._q3_k(raw)
    return np.abs(sub).reshape(-1, 2).max(axis=1)


@pytest.mark.parametrize(("name", "bits", "steps"), [("Q6_K", 8, 4), ("Q6_K", 6, 1), ("Q3_K", 4, 2)])
def test_sixteen_wide_types_keep_the_coarser_half_exact(name: str, bits: int, steps: int) -> None:
    """Q6_K/Q3_K: per 32-group, the sub-block with the larger scale is exact;
    the other is off by at most one step of the new grid (``s_big / steps``:
    half a step from rounding, a whole one only where it is clipped at the top)."""
    raw, ref = _blocks(name)
    q = to_mlx(raw, name, SHAPE, q6k_bits=bits)
    assert q.bits == bits and not q.exact
    got = _dequant(q).reshape(-1, 2, 16)
    ref = ref.reshape(-1, 2, 16)
    big = _sub_scales(name, raw)
    err = np.abs(got - ref).max(axis=2)  # (groups, 2)
    assert (err.min(axis=1) <= 1e-6 * np.abs(ref).max()).all()  # one half exact
    assert (err.max(axis=1) <= big / steps * (1 + 1e-5) + 1e-7).all()
    rounded = np.abs(got - ref).reshape(-1) <= (np.repeat(big, 32) / steps / 2 * (1 + 1e-5) + 1e-7)
    assert rounded.mean() > 0.99  # clipping is the exception


def test_q2_k_rounds_to_half_a_four_bit_step() -> None:
    raw, ref = _blocks("Q2_K")
    q = to_mlx(raw, "Q2_K", SHAPE)
    assert q.bits == 4 and not q.exact
    groups = ref.reshape(-1, 32)
    step = (groups.max(axis=1) - groups.min(axis=1)) / 15
    err = np.abs(_dequant(q).reshape(-1, 32) - groups).max(axis=1)
    assert (err <= step / 2 * (1 + 1e-4) + 1e-7).all()
    assert set(RELAID_TYPES) == {"Q2_K", "Q3_K", "Q6_K"}


def test_float16_scales_are_within_one_rounding() -> None:
    """Q4_K's group scale ``d * sc`` needs up to 17 significant bits: float16
    rounds it by at most 2^-11 relatively (what ``scale_dtype="float16"`` costs)."""
    raw, ref = _blocks("Q4_K")
    q = to_mlx(raw, "Q4_K", SHAPE)
    s16, b16 = q.scales.astype(np.float16), q.biases.astype(np.float16)
    assert not np.array_equal(s16.astype(np.float32), q.scales)  # not exact ...
    got = np.array(mx.dequantize(mx.array(q.weight), mx.array(s16), mx.array(b16), group_size=32, bits=4))
    g = ref.reshape(-1, 32)
    bound = (np.abs(q.scales).reshape(-1) * 15 + np.abs(q.biases).reshape(-1)) * 2.0**-10
    assert (np.abs(got.reshape(-1, 32) - g).max(axis=1) <= bound + 1e-7).all()  # ... but close
