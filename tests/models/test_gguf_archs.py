"""Every GGUF architecture afm converts: a tiny random GGUF written with the
``gguf`` package, converted, loaded as the mlx-lm model class it maps to,
and its logits compared with a numpy forward of the same dequantized
tensors as llama.cpp computes it (``numpy_ref.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from afm_core._errors import GGUFError
from afm_core._models.gguf.convert import SUPPORTED_ARCHITECTURES, convert_gguf

from . import gguf_build as gb
from . import numpy_ref

HIDDEN, HEADS, KV, HEAD_DIM, FF, EXPERTS, EXPERT_FF = 256, 4, 2, 64, 512, 4, 256
#: exact types, cycled over the model's matrices (so every architecture sees several)
MATRIX_TYPES = ("Q4_K", "Q5_0", "Q8_0", "Q5_K", "Q4_0", "Q4_1", "Q5_1", "IQ4_NL", "IQ4_XS", "F16", "BF16")
IDS = [3, 17, 250, 99, 100, 42, 7, 258, 1, 64, 200, 33]


class Model:
    """A tiny GGUF being assembled: tensors, the values they stand for, metadata."""

    def __init__(self, arch: str, rng: np.random.Generator, *, types: tuple[str, ...] = MATRIX_TYPES):
        self.arch, self.rng, self.types = arch, rng, types
        self.tensors: list[tuple[str, np.ndarray, str]] = []
        self.values: dict[str, np.ndarray] = {}
        self.meta: dict[str, Any] = {**gb.byte_vocab_metadata(), "general.name": f"tiny-{arch}"}
        self.vocab = len(self.meta["tokenizer.ggml.tokens"])
        self._next = 0

    def add(self, name: str, shape: tuple[int, ...], type_name: str | None = None,
            std: float = 0.05, values: np.ndarray | None = None) -> None:
        if type_name is None:
            type_name = self.types[self._next % len(self.types)]
            self._next += 1
        data, deq = gb.encode(values, type_name, shape, self.rng, std)
        self.tensors.append((name, data, type_name))
        self.values[name] = deq

    def norm(self, name: str, n: int = HIDDEN) -> None:
        self.add(name, (n,), "F32", values=(1 + 0.2 * self.rng.standard_normal(n)).astype(np.float32))

    def hparams(self, **extra: Any) -> None:
        a = self.arch
        self.meta.update({f"{a}.{k}": v for k, v in {
            "context_length": 512, "embedding_length": HIDDEN, "feed_forward_length": FF,
            "attention.head_count": HEADS, "attention.head_count_kv": KV,
            "attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM,
            "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0, **extra,
        }.items()})  # fmt: skip

    def write(self, path: Path) -> Path:
        return gb.write_gguf(path, self.arch, self.meta, self.tensors)


def build(arch: str, seed: int = 0, *, tied: bool = False, **variant: Any) -> tuple[Model, dict[str, Any]]:
    """A tiny ``arch`` model and the reference's hyperparameters."""
    m = Model(arch, np.random.default_rng(seed))
    gemma = arch.startswith("gemma")
    layers = 6 if arch == "gemma3" else 2
    hp: dict[str, Any] = {"heads": HEADS, "kv_heads": KV, "head_dim": HEAD_DIM, "eps": 1e-6,
                          "rope_base": 10000.0, "hidden": HIDDEN, "layers": layers}
    extra: dict[str, Any] = {"block_count": layers}
    m.add("token_embd.weight", (m.vocab, HIDDEN), variant.get("embed_type", "Q4_K" if tied or gemma else "Q8_0"),
          std=0.5 if not gemma else 0.05)
    m.norm("output_norm.weight")
    if not (tied or gemma):
        m.add("output.weight", (m.vocab, HIDDEN))
    for layer in range(layers):
        p = f"blk.{layer}"
        m.norm(f"{p}.attn_norm.weight")
        m.norm(f"{p}.ffn_norm.weight")
        if arch == "phi3":
            m.add(f"{p}.attn_qkv.weight", ((HEADS + 2 * KV) * HEAD_DIM, HIDDEN))
        else:
            m.add(f"{p}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN))
            m.add(f"{p}.attn_k.weight", (KV * HEAD_DIM, HIDDEN))
            m.add(f"{p}.attn_v.weight", (KV * HEAD_DIM, HIDDEN))
        m.add(f"{p}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM))
        if arch == "qwen2":
            for n, rows in (("q", HEADS), ("k", KV), ("v", KV)):
                m.add(f"{p}.attn_{n}.bias", (rows * HEAD_DIM,), "F32", std=0.1)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            m.norm(f"{p}.attn_q_norm.weight", HEAD_DIM)
            m.norm(f"{p}.attn_k_norm.weight", HEAD_DIM)
        if gemma:
            m.norm(f"{p}.post_attention_norm.weight")
            m.norm(f"{p}.post_ffw_norm.weight")
        if arch == "qwen3moe":
            m.add(f"{p}.ffn_gate_inp.weight", (EXPERTS, HIDDEN), "F32", std=0.3)
            m.add(f"{p}.ffn_gate_exps.weight", (EXPERTS, EXPERT_FF, HIDDEN))
            m.add(f"{p}.ffn_up_exps.weight", (EXPERTS, EXPERT_FF, HIDDEN))
            m.add(f"{p}.ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FF))
        elif arch == "phi3":
            m.add(f"{p}.ffn_up.weight", (2 * FF, HIDDEN))
            m.add(f"{p}.ffn_down.weight", (HIDDEN, FF))
        else:
            m.add(f"{p}.ffn_gate.weight", (FF, HIDDEN))
            m.add(f"{p}.ffn_up.weight", (FF, HIDDEN))
            m.add(f"{p}.ffn_down.weight", (HIDDEN, FF))
    if arch == "gemma2":
        extra.update({"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                      "attention.sliding_window": 4096})
        hp.update(attn_softcap=50.0, final_softcap=30.0)
    if arch == "gemma3":
        extra.update({"attention.sliding_window": 4, "rope.freq_base": 1e6})
        hp.update(window=4, rope_base=1e6)
    if arch == "qwen3moe":
        extra.update({"expert_count": EXPERTS, "expert_used_count": 2,
                      "expert_feed_forward_length": EXPERT_FF})
        hp["experts_used"] = 2
    if arch == "phi3":
        extra["rope.dimension_count"] = 48
        hp["rope_dims"] = 48
    if variant.get("window"):  # llama.cpp ignores a llama file's window: so does the reference
        extra["attention.sliding_window"] = variant["window"]
    m.hparams(**extra)
    return m, hp


def _mlx_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def _check(tmp_path: Path, arch: str, **variant: Any) -> dict[str, Any]:
    m, hp = build(arch, **variant)
    src = m.write(tmp_path / f"{arch}.gguf")
    out = convert_gguf(src, tmp_path / "out", scale_dtype="float32")
    expected = numpy_ref.forward(arch, hp, m.values, IDS)
    got = _mlx_logits(out, IDS)
    # float32 products of float32 values: a few ulps of the largest logit per
    # accumulated term; the quantized weights are the same values exactly.
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-4 * np.abs(expected).max() + 1e-5)
    return dict(json.loads((out / "config.json").read_text()))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_architecture_matches_numpy_reference(tmp_path: Path, arch: str) -> None:
    cfg = _check(tmp_path, arch)
    assert cfg["quantization"]["group_size"] == 32
    bits = {v["bits"] for k, v in cfg["quantization"].items() if isinstance(v, dict)}
    assert bits | {cfg["quantization"]["bits"]} >= {4, 5, 8}  # several types, several layouts


def test_llama_tied_quantized_embedding_and_sliding_window(tmp_path: Path) -> None:
    cfg = _check(tmp_path, "llama", tied=True, window=5)
    assert cfg["tie_word_embeddings"] is True
    embed = cfg["quantization"].get("model.embed_tokens", cfg["quantization"])
    assert embed["bits"] == 4  # Q4_K, as an mlx-lm QuantizedEmbedding (its as_linear is the head)
    assert "layer_types" not in cfg and "sliding_window" not in cfg


def test_gemma3_window_and_scale_reach_the_model(tmp_path: Path) -> None:
    cfg = _check(tmp_path, "gemma3")
    assert (cfg["model_type"], cfg["sliding_window"], cfg["sliding_window_pattern"]) == ("gemma3_text", 4, 6)
    assert cfg["query_pre_attn_scalar"] == HEAD_DIM and cfg["rope_local_base_freq"] == 10000.0


def test_llama_permutation_matters(tmp_path: Path) -> None:
    """The numpy reference rotates llama.cpp's interleaved pairs; leaving the
    GGUF rows as stored in the mlx-lm model (NEOX pairs) gives other logits."""
    m, hp = build("llama")
    src = m.write(tmp_path / "l.gguf")
    out = convert_gguf(src, tmp_path / "out", scale_dtype="float32", dequantize=True)
    neox = numpy_ref.forward("qwen3", hp, m.values, IDS)  # same model, rotate-half pairs, no unpermute
    expected = numpy_ref.forward("llama", hp, m.values, IDS)
    assert np.abs(neox - expected).max() > 1e-2 * np.abs(expected).max()
    np.testing.assert_allclose(_mlx_logits(out, IDS), expected, rtol=0, atol=2e-4 * np.abs(expected).max())


def test_float16_scales_stay_close(tmp_path: Path) -> None:
    """The default float16 scales round each group's scale and bias once
    (relative 2^-11): the logits move by a small fraction of their range."""
    m, hp = build("qwen2")
    src = m.write(tmp_path / "q.gguf")
    out = convert_gguf(src, tmp_path / "out")
    raw = mx.load(str(out / "model.safetensors"))
    assert raw["model.layers.0.self_attn.q_proj.scales"].dtype == mx.float16
    expected = numpy_ref.forward("qwen2", hp, m.values, IDS)
    np.testing.assert_allclose(_mlx_logits(out, IDS), expected, rtol=0, atol=5e-3 * np.abs(expected).max())


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    m, _ = build("llama")
    m.meta["general.architecture"] = "mamba"
    m.arch = "mamba"
    with pytest.raises(GGUFError, match=r"unsupported GGUF architecture 'mamba' \(supported: gemma2, "):
        convert_gguf(m.write(tmp_path / "m.gguf"), tmp_path / "out")


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    from afm_core._models.gguf.convert import check_tensor_types
    from afm_core._models.gguf.reader import read_gguf_info

    m, _ = build("qwen3")
    info = read_gguf_info(m.write(tmp_path / "m.gguf"))
    t = info.tensors[3]
    iq2 = type(t)(t.name, t.shape, 16, t.offset)  # IQ2_XXS: a codebook type afm does not convert
    broken = type(info)(info.path, info.version, info.metadata,
                        (*info.tensors[:3], iq2, *info.tensors[4:]), info.data_offset)
    with pytest.raises(GGUFError, match=r"unsupported GGUF tensor type\(s\) IQ2_XXS \(1 tensors\)"):
        check_tensor_types(broken)


def test_converted_model_runs_on_afm_cpu_kernels(tmp_path: Path) -> None:
    """Every bit width the conversion writes (4, 5, 6, 8) runs under
    ``fuse_for_cpu``: layouts afm's kernels cover switch to them, the others
    stay on MLX's ``quantized_matmul``; the logits agree with the unfused
    model within the kernels' int8 activation rounding (about 1% of the
    largest output, ``tests/mlx/test_qmatmul.py``)."""
    from mlx_lm.utils import load_model

    from afm_core._mlx.fusion import fuse_for_cpu, unfuse_cpu_kernels
    from afm_core._mlx.qmatmul import qmm_available, supports

    m = Model("qwen2", np.random.default_rng(5), types=("Q4_K", "Q5_0", "Q6_K", "Q8_0"))
    m_built, _ = build("qwen2")
    m.meta, m.tensors, m.values = m_built.meta, [], {}
    for name, _, type_name in m_built.tensors:
        shape = m_built.values[name].shape
        m.add(name, shape, None if len(shape) == 2 and name != "token_embd.weight" else type_name)
    out = convert_gguf(m.write(tmp_path / "q.gguf"), tmp_path / "out", q6k_bits=6)
    model, _ = load_model(out)
    layers = [mod for _, mod in model.named_modules() if hasattr(mod, "bits")]
    assert {mod.bits for mod in layers} == {4, 5, 6, 8}
    plain = np.array(model(mx.array([IDS]))[0])
    fuse_for_cpu(model)
    for mod in layers:
        fast = qmm_available() and supports(mod["weight"], mod["scales"], mod["biases"],
                                            mod.group_size, mod.bits)
        assert (type(mod).__name__ != "QuantizedLinear") == fast or "Embedding" in type(mod).__name__
    fused = np.array(model(mx.array([IDS]))[0])
    unfuse_cpu_kernels(model)
    np.testing.assert_allclose(fused, plain, rtol=0, atol=0.03 * np.abs(plain).max())
