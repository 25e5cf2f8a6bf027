"""A byte-level BPE tokenizer trained offline on a bundled corpus.

Its special tokens are the ones real chat models use, so templates, reasoning
and tool-call parsing see realistic token streams.  Training is deterministic
for a given vocabulary size.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

# (content, special): special tokens are dropped by skip_special_tokens;
# the others (like Qwen's) stay in decoded text.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
)
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"


def corpus_text() -> str:
    return resources.files("afm_core.testing").joinpath("corpus.txt").read_text("utf-8")


def chat_template() -> str:
    return resources.files("afm_core.testing").joinpath("chat_template.jinja").read_text("utf-8")


def train_byte_level_bpe(lines: list[str], vocab_size: int,
                         special_tokens: list[str] | None = None) -> Any:
    """A GPT-2/Qwen-style byte-level BPE ``tokenizers.Tokenizer`` trained on
    ``lines`` (``special_tokens`` first, at ids 0..)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens or [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def train_tokenizer(vocab_size: int = 1024) -> Any:
    """Train and return a ``tokenizers.Tokenizer`` (ids 0.. are the added tokens)."""
    from tokenizers import Tokenizer

    tok = train_byte_level_bpe(corpus_text().splitlines(keepends=True), vocab_size,
                               [t for t, _ in ADDED_TOKENS])
    # Mark the non-special ones as such, as Qwen's tokenizer.json does.
    data = json.loads(tok.to_str())
    special = dict(ADDED_TOKENS)
    for entry in data["added_tokens"]:
        entry["special"] = special[entry["content"]]
        entry["normalized"] = False
    return Tokenizer.from_str(json.dumps(data))


def write_tokenizer(tok: Any, out: Path, *, model_max_length: int) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json.

    Returns the ids of the added tokens by content.
    """
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t, _ in ADDED_TOKENS}
    decoder = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for t, special in ADDED_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "chat_template": chat_template(),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2)
    )
    return ids
