"""Tiny offline tokenizers for the stream-core tests and benchmark.

Trained with the ``tokenizers`` library on a small multilingual text, so
CJK, emoji and accented characters split across several tokens.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from afm_core.testing._tokenizer import train_byte_level_bpe

CORPUS = """\
The quick brown fox jumps over the lazy dog. Streaming text arrives one token at a time.
Local inference runs the model on your own machine: no network, just weights and a tokenizer.
def add(a: int, b: int) -> int:\n    return a + b\n
{"name": "read_file", "arguments": {"path": "README.md", "limit": 200}}
Café, naïve, façade, jalapeño, Ünïcödé, ½ and © are fine; so is the em dash — and “quotes”.
今天天气很好，我们去公园散步吧。中文分词是一个有趣的问题。東京は日本の首都です。
한국어 문장도 조금 있습니다. Привет, мир! Γειά σου κόσμε. مرحبا بالعالم
Emoji: 😀 🎉 👍🏽 👨‍👩‍👧 🇫🇷 ❤️ and math: ∑ ∫ √2 ≈ 1.414.
<think>Let me reason about this step by step.</think>The answer is 42.
"""

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NON_SPECIAL = ("<think>", "</think>", "<tool_call>", "</tool_call>", "hello world", "café")

LLAMA_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
}
METASPACE_BF_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ],
}
METASPACE_DECODER = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}


def _lines() -> list[str]:
    return CORPUS.splitlines(keepends=True) * 3


def _add_tokens(tok: Any) -> Any:
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL])
    return tok


@cache
def _byte_level_json(vocab_size: int) -> str:
    return str(_add_tokens(train_byte_level_bpe(_lines(), vocab_size)).to_str())


def byte_level(vocab_size: int = 700) -> Any:
    """A GPT-2/Qwen-style byte-level BPE; 256 gives single-byte tokens only."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_byte_level_json(vocab_size))


@cache
def _spm_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    # A fixed alphabet (printable ASCII and the metaspace) makes training
    # deterministic: with a frequency cut-off, ties between rare characters
    # were broken differently from run to run.  Everything else falls back to
    # <0xNN> bytes.
    alphabet = [chr(c) for c in range(32, 127)] + ["▁"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(_lines(), trainer=trainer)
    # Put the 256 byte tokens into the model vocab, as Llama's has them.
    data = json.loads(tok.to_str())
    old = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab: dict[str, int] = {}
    for token, _ in old[:3]:
        vocab[token] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token, _ in old[3:]:
        vocab.setdefault(token, len(vocab))
    data["model"]["vocab"] = vocab
    for entry in data["added_tokens"]:
        entry["id"] = vocab[entry["content"]]
    return json.dumps(data)


def sentencepiece(decoder: dict[str, Any] | None = None, vocab_size: int = 400) -> Any:
    """A Llama-style byte-fallback BPE with a Metaspace pre-tokenizer."""
    from tokenizers import Tokenizer

    data = json.loads(_spm_json(vocab_size))
    data["decoder"] = decoder or LLAMA_DECODER
    return _add_tokens(Tokenizer.from_str(json.dumps(data)))
