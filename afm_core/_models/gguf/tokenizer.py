"""Rebuild Hugging Face tokenizer files from GGUF tokenizer metadata.

Two GGUF vocabularies are supported:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE.  ``tokens`` and
  ``merges`` become a ``tokenizers`` BPE model; the pre-tokenizer follows
  ``tokenizer.ggml.pre`` (llama.cpp's table of regexes).
* ``tokenizer.ggml.model == "llama"``: SentencePiece BPE with byte fallback.
  Merges are recovered from the piece scores the way ``transformers``'
  ``LlamaConverter`` does.

Tokens typed *control* become special added tokens, *user-defined* ones plain
added tokens.  The output is plain JSON (``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``) that
``transformers.AutoTokenizer`` and ``mlx_lm.load`` read offline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._errors import GGUFError

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_REGEX = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> pre-tokenizer family (see llama.cpp's llama-vocab.cpp).
_PRE_FAMILIES: dict[str, str] = {
    **dict.fromkeys(["default", "gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "olmo", "jais"], "gpt2"),
    **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"], "digits"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"], "llama3"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], "qwen2"),
}  # fmt: skip

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _bpe_pre_tokenizer(pre: str) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
    """(pre_tokenizer, normalizer, ignore_merges) for ``tokenizer.ggml.pre``."""
    family = _PRE_FAMILIES.get(pre)
    no_regex = {**_BYTE_LEVEL, "use_regex": False}
    if family == "gpt2":
        return _BYTE_LEVEL, None, False
    if family == "digits":
        digits = {"type": "Digits", "individual_digits": True}
        return {"type": "Sequence", "pretokenizers": [digits, _BYTE_LEVEL]}, None, False
    if family == "llama3":
        seq = {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_REGEX), no_regex]}
        return seq, None, True
    if family == "qwen2":
        seq = {"type": "Sequence", "pretokenizers": [_split(_QWEN2_REGEX), no_regex]}
        return seq, {"type": "NFC"}, False
    known = ", ".join(sorted(_PRE_FAMILIES))
    raise GGUFError(
        f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} (supported: {known})"
    )


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[dict[str, Any]]:
    added = []
    for i, (tok, ttype) in enumerate(zip(tokens, types, strict=True)):
        if ttype in (CONTROL, USER_DEFINED) or (ttype == UNKNOWN and tok):
            added.append(
                {
                    "id": i,
                    "content": tok,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": ttype == USER_DEFINED,
                    "special": ttype != USER_DEFINED,
                }
            )
    return added


def _post_processor(
    bos: str | None, eos: str | None, add_bos: bool, add_eos: bool, ids: dict[str, int]
) -> dict[str, Any] | None:
    pieces_a: list[dict[str, Any]] = []
    pieces_b: list[dict[str, Any]] = []
    special: dict[str, Any] = {}
    if add_bos and bos is not None:
        pieces_a.append({"SpecialToken": {"id": bos, "type_id": 0}})
        pieces_b.append({"SpecialToken": {"id": bos, "type_id": 1}})
        special[bos] = {"id": bos, "ids": [ids[bos]], "tokens": [bos]}
    pieces_a.append({"Sequence": {"id": "A", "type_id": 0}})
    pieces_b.append({"Sequence": {"id": "B", "type_id": 1}})
    if add_eos and eos is not None:
        pieces_a.append({"SpecialToken": {"id": eos, "type_id": 0}})
        pieces_b.append({"SpecialToken": {"id": eos, "type_id": 1}})
        special[eos] = {"id": eos, "ids": [ids[eos]], "tokens": [eos]}
    if not special:
        return None
    return {"type": "TemplateProcessing", "single": pieces_a, "pair": pieces_a + pieces_b,
            "special_tokens": special}  # fmt: skip


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[list[str]]:
    """Merges implied by SentencePiece scores (as transformers' LlamaConverter)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, UNUSED)}
    order = sorted(vocab, key=lambda t: -float(scores[vocab[t]]))
    merges: list[tuple[str, str, float]] = []
    for piece in order:
        score = float(scores[vocab[piece]])
        local = [
            (piece[:k], piece[k:], score)
            for k in range(1, len(piece))
            if piece[:k] in vocab and piece[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: -m[2])  # stable: keeps the per-piece order
    return [[a, b] for a, b, _ in merges]


def build_tokenizer_files(metadata: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The JSON documents of a Hugging Face tokenizer for a GGUF's metadata.

    Returns ``{"tokenizer.json": ..., "tokenizer_config.json": ...,
    "special_tokens_map.json": ...}``; raises :class:`GGUFError` when the
    vocabulary type or pre-tokenizer is not supported.
    """
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise GGUFError("the GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)")
    tokens = list(tokens)
    raw_types = metadata.get("tokenizer.ggml.token_type")
    types = [int(t) for t in raw_types] if raw_types is not None else [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")

    def token_at(key: str) -> str | None:
        idx = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if idx is None:
            return None
        idx = int(idx)
        if not 0 <= idx < len(tokens):
            raise GGUFError(f"tokenizer.ggml.{key}_token_id={idx} is outside the vocabulary")
        return str(tokens[idx])

    bos, eos, unk, pad = token_at("bos"), token_at("eos"), token_at("unknown"), token_at("padding")
    ids: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        ids.setdefault(tok, i)
    added = _added_tokens(tokens, types)

    if model == "gpt2":
        merges_raw = metadata.get("tokenizer.ggml.merges")
        if merges_raw is None:
            raise GGUFError("a gpt2 (BPE) GGUF vocabulary without tokenizer.ggml.merges")
        merges = [m.split(" ", 1) for m in merges_raw]
        if any(len(m) != 2 for m in merges):
            raise GGUFError("malformed tokenizer.ggml.merges entry (expected 'left right')")
        pre_tok, normalizer, ignore_merges = _bpe_pre_tokenizer(
            str(metadata.get("tokenizer.ggml.pre", "default"))
        )
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        bpe = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
               "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
               "ignore_merges": ignore_merges, "vocab": ids, "merges": merges}  # fmt: skip
        decoder: dict[str, Any] = {**_BYTE_LEVEL}
        legacy_post: dict[str, Any] | None = {**_BYTE_LEVEL, "trim_offsets": False}
    elif model == "llama":
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise GGUFError("a SentencePiece (llama) GGUF vocabulary without tokenizer.ggml.scores")
        prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
        if unk is None and "<unk>" in ids:
            unk = "<unk>"
        bpe = {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
               "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
               "ignore_merges": False, "vocab": ids,
               "merges": _spm_merges(tokens, scores, types)}  # fmt: skip
        replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
        prepend = {"type": "Prepend", "prepend": "\u2581"}
        normalizer = {"type": "Sequence", "normalizers": [prepend, replace] if prefix else [replace]}
        pre_tok = None
        steps: list[dict[str, Any]] = [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ]
        if prefix:
            steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        decoder = {"type": "Sequence", "decoders": steps}
        legacy_post = None
    else:
        raise GGUFError(
            f"unsupported GGUF vocabulary tokenizer.ggml.model={model!r} "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )

    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    post = _post_processor(bos, eos, add_bos, add_eos, ids) or legacy_post
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tok,
        "post_processor": post,
        "decoder": decoder,
        "model": bpe,
    }
    special_map = {
        k: v
        for k, v in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad))
        if v is not None
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get(f"{metadata.get('general.architecture', 'llama')}.context_length", 0) or 1 << 20),
    }
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": config,
        "special_tokens_map.json": special_map,
    }
