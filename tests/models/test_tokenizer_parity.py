"""The GGUF tokenizer rebuild gives llama.cpp's token ids.

Default suite: ids stored in ``data/tokenizer_llamacpp.json`` (produced by
llama.cpp, ``python -m tests.models.tokenizer_ref``) for tiny vocabularies,
one per pre-tokenizer family and SentencePiece variant, and for pruned copies
of two real Apache-2.0 vocabularies (Qwen2.5-Coder, SmolLM2; Gemma 3 live only); the rebuilt
``tokenizer.json`` must give exactly those ids, through ``tokenizers`` and
through ``transformers.AutoTokenizer`` as mlx-lm loads it.

Opt-in (``AFM_LLAMACPP_TESTS=1``, with ``xllamacpp`` installed): the same
against llama.cpp live, on tiny GGUF files written here and on the real GGUF
files of ``AFM_REAL_GGUF_DIR`` (default: the real-GGUF fetcher's cache, ``$AFM_HOME/downloads/real``) over the whole corpus.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from afm_core._models.gguf.tokenizer import build_tokenizer_files

from . import tokenizer_ref as ref
from .tokenizer_corpus import corpus

FIXTURE = json.loads(ref.DATA.read_text())
TEXTS = ref.fixture_texts()
LIVE = os.environ.get("AFM_LLAMACPP_TESTS", "") not in ("", "0")


def _tokenizer(meta: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(build_tokenizer_files(meta)["tokenizer.json"]))


def _expected(rows: list[str]) -> list[list[int]]:
    return [[int(i) for i in row.split()] for row in rows]


def _mismatches(tok: Any, texts: list[str], expected: list[list[int]], remap: Any = None) -> list[str]:
    bad = []
    for text, want in zip(texts, expected, strict=True):
        got = tok.encode(text, add_special_tokens=True).ids
        if remap is not None:
            got = [remap[i] for i in got]
        if got != want:
            bad.append(f"{text!r}: llama.cpp {want} afm {got}")
    return bad


CASES = ref.tiny_cases(FIXTURE["vocabs"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiny_vocabulary_matches_llamacpp(name: str) -> None:
    bad = _mismatches(_tokenizer(CASES[name]), TEXTS, _expected(FIXTURE["expected"][name]))
    assert not bad, f"{len(bad)} of {len(TEXTS)} differ:\n" + "\n".join(bad[:10])


@pytest.mark.parametrize("name", sorted(FIXTURE["real"]))
def test_real_vocabulary_matches_llamacpp(name: str) -> None:
    case = FIXTURE["real"][name]
    bad = _mismatches(_tokenizer(case["metadata"]), TEXTS, _expected(case["expected"]), remap=case["ids"])
    assert not bad, f"{len(bad)} of {len(TEXTS)} differ:\n" + "\n".join(bad[:10])


@pytest.mark.parametrize("name", ["bpe-llama-bpe", "spm-noprefix", "spm-prefix", "qwen2.5-coder"])
def test_autotokenizer_as_mlx_lm_loads_it(name: str, tmp_path: Path) -> None:
    """The files on disk, read by transformers (as mlx-lm does), give the same ids."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    case = FIXTURE["real"].get(name)
    meta = case["metadata"] if case else CASES[name]
    files = build_tokenizer_files(meta)
    for file, doc in files.items():
        (tmp_path / file).write_text(json.dumps(doc, ensure_ascii=False))
    hf = load_tokenizer(tmp_path)._tokenizer
    expected = _expected(case["expected"] if case else FIXTURE["expected"][name])
    for text, want in zip(TEXTS, expected, strict=True):
        got = hf.encode(text)
        assert (got if case is None else [case["ids"][i] for i in got]) == want, text


# --- opt-in: llama.cpp itself ---------------------------------------------------------

live = pytest.mark.skipif(not LIVE, reason="set AFM_LLAMACPP_TESTS=1 (needs xllamacpp) to compare with llama.cpp live")


@live
@pytest.mark.parametrize("name", sorted(CASES))
def test_live_tiny_vocabulary(name: str, tmp_path: Path) -> None:
    pytest.importorskip("xllamacpp")
    texts = corpus()
    want = ref.llamacpp_tokenize(ref.write_gguf(tmp_path / "t.gguf", CASES[name]), texts)
    bad = _mismatches(_tokenizer(CASES[name]), texts, want)
    assert not bad, f"{len(bad)} of {len(texts)} differ:\n" + "\n".join(bad[:10])


@live
@pytest.mark.parametrize("name", sorted(ref.REAL_FILES))
def test_live_real_gguf(name: str) -> None:
    pytest.importorskip("xllamacpp")
    path = Path(os.environ.get("AFM_REAL_GGUF_DIR") or ref.fetched_dir()) / ref.REAL_FILES[name]
    if not path.exists():
        pytest.skip(f"{ref.REAL_FILES[name]} not found: afm testing fetch-real fetches it")
    texts = corpus()
    meta = dict(ref._read_metadata(path))
    bad = _mismatches(_tokenizer(meta), texts, ref.llamacpp_tokenize(path, texts))
    assert not bad, f"{len(bad)} of {len(texts)} differ:\n" + "\n".join(bad[:10])


# --- end of generation ------------------------------------------------------------------


def test_every_end_of_turn_token_stops_generation(tmp_path: Path) -> None:
    """llama.cpp's EOG set (EOS, end-of-turn and FIM markers, control-looking
    texts) reaches mlx-lm's stop set through generation_config.json."""
    import mlx_lm

    from afm_core._models.gguf.convert import convert_gguf

    meta = CASES["bpe-qwen2"]
    tokens = meta["tokenizer.ggml.tokens"]
    out = convert_gguf(ref.write_gguf(tmp_path / "t.gguf", meta), tmp_path / "m")
    _, tokenizer = mlx_lm.load(str(out))
    eog = {tokens[i] for i in tokenizer.eos_token_ids}
    assert eog == {"<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|fim_pad|>", "</s>"}
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == sorted(
        tokens.index(t) for t in eog)
    # "</s>" and "<|fim_pad|>" are normal entries in the file: llama.cpp makes them control tokens
    hf = tokenizer._tokenizer
    assert hf.encode("a</s>b", add_special_tokens=False)[1] == tokens.index("</s>")
    assert hf.decode([tokens.index("<|im_end|>")], skip_special_tokens=True) == ""


def test_vocabulary_errors_are_clear() -> None:
    from afm_core._errors import GGUFError

    meta = dict(CASES["bpe-qwen2"])
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.pre='unknown-pre'.*supported: .*llama-bpe"):
        build_tokenizer_files({**meta, "tokenizer.ggml.pre": "unknown-pre"})
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.model='bert'"):
        build_tokenizer_files({**meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(GGUFError, match=r"has no tokenizer"):
        build_tokenizer_files({"general.architecture": "llama"})
    with pytest.raises(GGUFError, match=r"without tokenizer.ggml.merges"):
        build_tokenizer_files({k: v for k, v in meta.items() if k != "tokenizer.ggml.merges"})
    tiny = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": list("abc"),
            "tokenizer.ggml.merges": [], "tokenizer.ggml.add_bos_token": True}  # BPE's default BOS 11: none
    with pytest.raises(GGUFError, match=r"add_bos_token is true, but tokenizer.ggml.bos_token_id"):
        build_tokenizer_files(tiny)
    spm = {k: v for k, v in CASES["spm-prefix"].items() if k != "tokenizer.ggml.scores"}
    with pytest.raises(GGUFError, match=r"without tokenizer.ggml.scores"):
        build_tokenizer_files(spm)


def test_chat_templates_from_the_file(tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from afm_core._models.loader import _default_template

    meta = {**CASES["bpe-qwen2"], "tokenizer.chat_template": "{{ 'plain' }}",
            "tokenizer.chat_template.tool_use": "{{ tools | length }} tools"}
    files = build_tokenizer_files(meta)
    assert files["tokenizer_config.json"]["chat_template"] == [
        {"name": "default", "template": "{{ 'plain' }}"}, {"name": "tool_use", "template": "{{ tools | length }} tools"}]
    for file, doc in files.items():
        (tmp_path / file).write_text(json.dumps(doc, ensure_ascii=False))
    hf = load_tokenizer(tmp_path)._tokenizer
    msgs = [{"role": "user", "content": "x"}]
    assert hf.apply_chat_template(msgs, tokenize=False) == "plain"
    assert hf.apply_chat_template(msgs, tools=[{"type": "function", "function": {"name": "f"}}],
                                  tokenize=False) == "1 tools"
    assert _default_template(hf.chat_template) == "{{ tools | length }} tools"
    assert "chat_template" not in build_tokenizer_files({**CASES["bpe-qwen2"], "tokenizer.chat_template": " "})[
        "tokenizer_config.json"]
