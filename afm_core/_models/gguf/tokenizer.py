"""Hugging Face tokenizer files that tokenize a GGUF's text exactly as llama.cpp.

``build_tokenizer_files(metadata)`` turns the tokenizer metadata of a GGUF
file into ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json`` and ``generation_config.json`` (the end-of-turn
ids), documents that ``transformers.AutoTokenizer`` and ``mlx_lm.load`` read
offline.  The vocabulary is first read as llama.cpp loads it
(:mod:`.vocab`); then:

* **special tokens** (control, user-defined, unknown; after llama.cpp's
  fix-ups) are added tokens matched on the raw text, as llama.cpp's
  ``tokenizer_st_partition`` with ``parse_special`` does: the text between
  them goes through the vocabulary's algorithm, they become their own id;
* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE.  The pre-tokenizer is
  llama.cpp's list of regexes for ``tokenizer.ggml.pre``
  (:mod:`.pretokenize`), applied in order, then the byte-to-unicode map; the
  merges are the file's, ranked in file order (the first of duplicates
  wins); no Unicode normalization (llama.cpp applies none: Qwen's NFC is
  *not* applied, so a decomposed "e\u0301" stays two characters);
* ``tokenizer.ggml.model == "llama"``: SentencePiece BPE as llama.cpp's
  ``llm_tokenizer_spm``: spaces become U+2581 (a leading one when
  ``add_space_prefix``), then adjacent symbols whose concatenation is *any*
  vocabulary entry merge, highest score first (the merge list is every such
  split of every entry, ordered by the entry's score); characters outside
  the vocabulary fall back to ``<0xNN>`` byte tokens.

What does not carry over: a BPE merge whose result is not in the vocabulary
(llama.cpp would emit the bytes of that symbol; the ``tokenizers`` library
cannot hold such a merge: it is dropped), and overlapping special tokens
(llama.cpp matches the longest token anywhere first, ``tokenizers`` the
leftmost-longest); neither occurs in the vocabularies checked
(``tests/models/test_tokenizer_parity.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._errors import GGUFError
from .pretokenize import bpe_pre_tokenizer, supported_pre_names
from .vocab import CONTROL, UNKNOWN, Vocab, read_vocab

__all__ = ["TOKENIZER_VERSION", "build_tokenizer_files"]

#: Bumped whenever the files built here change (GGUF conversion caches key on it).
TOKENIZER_VERSION = 2

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
SPACE = "\u2581"


def _added_tokens(vocab: Vocab) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "content": vocab.tokens[i],
            "single_word": False,
            "lstrip": i in vocab.lstrip,
            "rstrip": i in vocab.rstrip,
            "normalized": False,  # matched on the raw text, as llama.cpp does
            "special": vocab.types[i] in (CONTROL, UNKNOWN),
        }
        for i in vocab.special_tokens()
    ]


def _token_ids(vocab: Vocab) -> dict[str, int]:
    ids: dict[str, int] = {}
    for i, tok in enumerate(vocab.tokens):
        ids.setdefault(tok, i)
    return ids


def _post_processor(vocab: Vocab) -> dict[str, Any] | None:
    single: list[dict[str, Any]] = []
    pair: list[dict[str, Any]] = []
    special: dict[str, Any] = {}
    for key, on in (("bos", vocab.add_bos), ("eos", vocab.add_eos)):
        text = vocab.text_of(key)
        if on and text is not None:
            tid = vocab.special_ids[key]
            special[text] = {"id": text, "ids": [tid], "tokens": [text]}
    bos = vocab.text_of("bos") if vocab.add_bos else None
    eos = vocab.text_of("eos") if vocab.add_eos else None
    for seq, type_id, out in (("A", 0, single), ("A", 0, pair), ("B", 1, pair)):
        if bos is not None:
            out.append({"SpecialToken": {"id": bos, "type_id": type_id}})
        out.append({"Sequence": {"id": seq, "type_id": type_id}})
        if eos is not None:
            out.append({"SpecialToken": {"id": eos, "type_id": type_id}})
    if not special:
        return None
    return {"type": "TemplateProcessing", "single": single, "pair": pair,
            "special_tokens": special}  # fmt: skip


def _bpe_merges(vocab: Vocab, ids: dict[str, int]) -> list[list[str]]:
    """The file's merges as pairs, llama.cpp's way (split at the first space
    after the first character; the first of duplicates keeps its rank)."""
    seen: set[tuple[str, str]] = set()
    merges: list[list[str]] = []
    for entry in vocab.merges:
        pos = entry.find(" ", 1)
        if pos < 0:
            raise GGUFError(f"malformed tokenizer.ggml.merges entry {entry!r} (expected 'left right')")
        a, b = entry[:pos], entry[pos + 1 :]
        if (a, b) in seen or a not in ids or b not in ids or a + b not in ids:
            continue
        seen.add((a, b))
        merges.append([a, b])
    return merges


def _spm_merges(vocab: Vocab, ids: dict[str, int]) -> list[list[str]]:
    """Every split of every entry into two entries, best-scored entry first."""
    scores = vocab.scores
    merges: list[tuple[float, int, int, int, str, str]] = []
    for piece, pid in ids.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            lid, rid = ids.get(left), ids.get(right)
            if lid is not None and rid is not None:
                merges.append((-scores[pid], pid, lid, rid, left, right))
    merges.sort()
    return [[left, right] for *_, left, right in merges]


def _gpt2_parts(vocab: Vocab, ids: dict[str, int]) -> dict[str, Any]:
    pre = bpe_pre_tokenizer(vocab.pre)
    if pre is None:
        raise GGUFError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={vocab.pre!r} "
            f"(supported: {', '.join(supported_pre_names())})"
        )
    splits = [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
        for regex in pre.regexes
    ]
    byte_level = {**_BYTE_LEVEL, "use_regex": False}
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [*splits, byte_level]},
        "decoder": dict(_BYTE_LEVEL),
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": pre.ignore_merges, "vocab": ids,
                  "merges": _bpe_merges(vocab, ids)},
    }


def _spm_parts(vocab: Vocab, ids: dict[str, int]) -> dict[str, Any]:
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    steps: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if vocab.add_space_prefix:
        normalizers = [{"type": "Prepend", "prepend": SPACE}, replace]
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    else:
        normalizers = [replace]
    unk = vocab.text_of("unk")
    return {
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": steps},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": ids, "merges": _spm_merges(vocab, ids)},
    }


def tokenizer_json(vocab: Vocab) -> dict[str, Any]:
    """The ``tokenizers`` document for ``vocab``."""
    ids = _token_ids(vocab)
    parts = _gpt2_parts(vocab, ids) if vocab.kind == "gpt2" else _spm_parts(vocab, ids)
    post = _post_processor(vocab)
    if post is None and vocab.kind == "gpt2":
        post = {**_BYTE_LEVEL, "trim_offsets": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(vocab),
        "normalizer": parts["normalizer"],
        "pre_tokenizer": parts["pre_tokenizer"],
        "post_processor": post,
        "decoder": parts["decoder"],
        "model": parts["model"],
    }


def _context_length(metadata: Mapping[str, Any]) -> int:
    arch = metadata.get("general.architecture", "llama")
    return int(metadata.get(f"{arch}.context_length", 0) or 1 << 20)


def _chat_template(metadata: Mapping[str, Any]) -> str | list[dict[str, str]] | None:
    """``tokenizer.chat_template``; with named ones (``tokenizer.chat_template.<name>``,
    e.g. ``tool_use``) the list of named templates transformers reads."""
    default = metadata.get("tokenizer.chat_template")
    named = {key.removeprefix("tokenizer.chat_template."): value for key, value in metadata.items()
             if key.startswith("tokenizer.chat_template.") and isinstance(value, str) and value.strip()}
    if not named:
        return default if isinstance(default, str) and default.strip() else None
    templates = [{"name": "default", "template": default}] if isinstance(default, str) and default.strip() else []
    return templates + [{"name": name, "template": text} for name, text in sorted(named.items())]


def build_tokenizer_files(metadata: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The JSON documents of a Hugging Face tokenizer for a GGUF's metadata.

    Returns ``{"tokenizer.json": ..., "tokenizer_config.json": ...,
    "special_tokens_map.json": ..., "generation_config.json": ...}``: the
    last holds ``eos_token_id``, the list of every end-of-generation token
    (llama.cpp's EOG set), which mlx-lm stops on.  The chat template
    (``tokenizer.chat_template``) goes into ``tokenizer_config.json``.
    Raises :class:`GGUFError` when the vocabulary kind or pre-tokenizer is
    not supported.
    """
    vocab = read_vocab(metadata)
    special_map = {
        name: text
        for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unk"),
                          ("pad_token", "pad"))
        if (text := vocab.text_of(key)) is not None
    }  # fmt: skip
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _context_length(metadata),
    }
    template = _chat_template(metadata)
    if template:
        config["chat_template"] = template
    generation: dict[str, Any] = {"eos_token_id": sorted(vocab.eog_ids)}
    if "bos" in vocab.special_ids:
        generation["bos_token_id"] = vocab.special_ids["bos"]
    return {
        "tokenizer.json": tokenizer_json(vocab),
        "tokenizer_config.json": config,
        "special_tokens_map.json": special_map,
        "generation_config.json": generation,
    }
