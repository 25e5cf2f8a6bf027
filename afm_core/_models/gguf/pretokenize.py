"""llama.cpp's BPE pre-tokenizers, by ``tokenizer.ggml.pre`` name.

Each entry mirrors ``llm_tokenizer_bpe``'s constructor and the ``pre_type``
table of ``llama_vocab::impl::load`` in llama.cpp's ``src/llama-vocab.cpp``:
the regular expressions llama.cpp applies *in order* (each one splits the
pieces the previous ones left; text a regex does not match stays a piece of
its own), whether whole words found in the vocabulary skip the merges
(``ignore_merges``), and whether a BOS token is added when the file does not
say (``add_bos``).

The regexes are llama.cpp's own strings (its adapted forms, e.g.
``'[sS]`` for ``(?i:'s)``), run by the ``tokenizers`` library as a sequence
of ``Split(..., "isolated")`` steps, which is the same splitting rule.  Only
pre-tokenizers whose regexes mean the same in llama.cpp (its hand-written
scanners, or ``std::regex`` over its collapsed Unicode categories) and in
Oniguruma are listed; :func:`bpe_pre_tokenizer` refuses the others by name.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRE_TOKENIZERS", "PreTokenizer", "bpe_pre_tokenizer", "supported_pre_names"]

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer: its regexes and the flags it sets."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_FAMILIES: tuple[tuple[tuple[str, ...], PreTokenizer], ...] = (
    (("default",),
     PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"),
     PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), PreTokenizer((LLAMA3,))),
    (("falcon",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"))),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
      "mellum2"),
     PreTokenizer((r"\p{N}", GPT2))),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
      "jina-v1-en", "jina-v2-code", "roberta-bpe"),
     PreTokenizer((GPT2,))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
      "solar-open"),
     PreTokenizer((QWEN2,))),
    (("qwen35",), PreTokenizer((QWEN35,))),
    (("tekken",), PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizer((GPT4O,))),
    (("seed-coder",), PreTokenizer((SEED_CODER,))),
)  # fmt: skip

#: ``tokenizer.ggml.pre`` name -> pre-tokenizer.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    name: pre for names, pre in _FAMILIES for name in names
}


def supported_pre_names() -> list[str]:
    return sorted(PRE_TOKENIZERS)


def bpe_pre_tokenizer(pre: str | None) -> PreTokenizer | None:
    """The pre-tokenizer for ``tokenizer.ggml.pre`` (a missing name is llama.cpp's
    ``default``); ``None`` when afm does not reproduce that one."""
    return PRE_TOKENIZERS.get(pre or "default")
