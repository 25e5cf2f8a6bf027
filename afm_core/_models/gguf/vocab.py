"""A GGUF vocabulary as llama.cpp sees it once loaded.

:func:`read_vocab` applies, to the metadata of a GGUF file, what
``llama_vocab::impl::load`` in llama.cpp's ``src/llama-vocab.cpp`` does
before it tokenizes anything:

* token types become attributes; an empty token is renamed ``[EMPTY_<id>]``;
* special ids come from the metadata, else from the vocabulary kind's
  defaults (SentencePiece: BOS 1, EOS 2, UNK 0; BPE: BOS = EOS = 11), ids
  outside the vocabulary dropped; ``add_bos`` / ``add_eos`` /
  ``add_space_prefix`` likewise;
* tokens that *look* like end-of-turn, end-of-message or fill-in-the-middle
  markers (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|fim_pad|>``,
  ...) become control tokens, and every end-of-generation marker joins the
  EOG set (the tokens that stop generation: EOS, EOT, EOM, FIM pad/repo/sep
  and the marker texts), with llama.cpp's two exceptions (harmony's
  ``<|end|>``, Gemma 4's ``</s>``);
* the *special* tokens, the ones split out of the text before the
  vocabulary's own algorithm runs, are the control, user-defined and
  unknown ones; Phi-3 and a few encoders strip whitespace around some.

It is pure (no I/O): the metadata mapping comes from the GGUF reader.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._errors import GGUFError

__all__ = ["Vocab", "read_vocab"]

# llama.cpp token types (tokenizer.ggml.token_type)
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 0, 1, 2, 3, 4, 5, 6

EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
             "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>",
             "<end_of_utterance>")  # fmt: skip
FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}  # fmt: skip
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})  # fmt: skip
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss


@dataclass
class Vocab:
    """The loaded vocabulary: texts, types (after llama.cpp's fix-ups) and flags."""

    kind: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    special_ids: dict[str, int]  # bos, eos, unk, pad, eot, eom, fim_* (present ones)
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: set[int] = field(default_factory=set)
    lstrip: set[int] = field(default_factory=set)
    rstrip: set[int] = field(default_factory=set)

    def text_of(self, key: str) -> str | None:
        tid = self.special_ids.get(key)
        return None if tid is None else self.tokens[tid]

    def special_tokens(self) -> list[int]:
        """Ids split out of the text before tokenizing (control, user-defined, unknown)."""
        return [i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED, UNKNOWN)]


def _strings(value: Any, key: str) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise GGUFError(f"{key} must be an array of strings")
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in value]


def _numbers(value: Any, n: int, key: str, cast: type) -> list[Any] | None:
    if value is None:
        return None
    out = [cast(v) for v in value]
    if len(out) < n:
        raise GGUFError(f"{key} has {len(out)} entries for {n} tokens")
    return out[:n]


def read_vocab(metadata: Mapping[str, Any]) -> Vocab:
    """The vocabulary of a GGUF file's metadata (see the module docstring)."""
    kind = metadata.get("tokenizer.ggml.model")
    raw_tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or raw_tokens is None:
        raise GGUFError("the GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)")
    kind = str(kind)
    if kind not in ("gpt2", "llama"):
        raise GGUFError(
            f"unsupported GGUF vocabulary tokenizer.ggml.model={kind!r} "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )
    tokens = _strings(raw_tokens, "tokenizer.ggml.tokens")
    n = len(tokens)
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    types = _numbers(metadata.get("tokenizer.ggml.token_type"), n, "tokenizer.ggml.token_type", int)
    scores = _numbers(metadata.get("tokenizer.ggml.scores"), n, "tokenizer.ggml.scores", float)
    merges: list[str] = []
    if kind == "gpt2":
        raw_merges = metadata.get("tokenizer.ggml.merges")
        if raw_merges is None:
            raise GGUFError("a gpt2 (BPE) GGUF vocabulary without tokenizer.ggml.merges")
        merges = _strings(raw_merges, "tokenizer.ggml.merges")
    elif scores is None:
        raise GGUFError("a SentencePiece (llama) GGUF vocabulary without tokenizer.ggml.scores")
    pre = metadata.get("tokenizer.ggml.pre")
    vocab = Vocab(
        kind=kind,
        pre=None if pre is None else str(pre),
        tokens=tokens,
        types=types if types is not None else [NORMAL] * n,
        scores=scores if scores is not None else [0.0] * n,
        merges=merges,
        special_ids={},
        add_bos=kind == "llama",
        add_eos=False,
        add_space_prefix=kind == "llama",
    )
    _special_ids(vocab, metadata)
    _flags(vocab, metadata)
    _mark_by_text(vocab)
    _strip_attributes(vocab, metadata)
    return vocab


def _special_ids(vocab: Vocab, metadata: Mapping[str, Any]) -> None:
    n = len(vocab.tokens)
    defaults = {"bos": 1, "eos": 2, "unk": 0} if vocab.kind == "llama" else {"bos": 11, "eos": 11}
    if vocab.pre in ("glm4", "chatglm-bpe"):
        defaults.pop("bos")
    ids = {k: v for k, v in defaults.items() if v < n}
    keys = {"bos": "bos", "eos": "eos", "eot": "eot", "eom": "eom", "unknown": "unk",
            "seperator": "sep", "padding": "pad", "mask": "mask", "prefix": "fim_pre",
            "suffix": "fim_suf", "middle": "fim_mid", "fim_pre": "fim_pre",
            "fim_suf": "fim_suf", "fim_mid": "fim_mid", "fim_pad": "fim_pad",
            "fim_rep": "fim_rep", "fim_sep": "fim_sep"}  # fmt: skip
    for gguf_key, name in keys.items():
        value = metadata.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if value is not None and 0 <= int(value) < n:
            ids[name] = int(value)
    vocab.special_ids = ids


def _flags(vocab: Vocab, metadata: Mapping[str, Any]) -> None:
    if vocab.kind == "gpt2":
        vocab.add_space_prefix = False
        from .pretokenize import bpe_pre_tokenizer

        pre = bpe_pre_tokenizer(vocab.pre)
        vocab.add_bos = bool(pre and pre.add_bos)
    prefix = metadata.get("tokenizer.ggml.add_space_prefix")
    if prefix is not None:
        vocab.add_space_prefix = bool(prefix)
    for key in ("bos", "eos"):
        value = metadata.get(f"tokenizer.ggml.add_{key}_token")
        if value is not None:
            setattr(vocab, f"add_{key}", bool(value))
    for key in ("bos", "eos"):
        if getattr(vocab, f"add_{key}") and key not in vocab.special_ids:
            raise GGUFError(f"tokenizer.ggml.add_{key}_token is true, but "
                            f"tokenizer.ggml.{key}_token_id is not set")


def _first_with_text(vocab: Vocab, by_text: dict[str, int], texts: Sequence[str]) -> int | None:
    return next((by_text[t] for t in texts if t in by_text), None)


def _mark_by_text(vocab: Vocab) -> None:
    """Control-looking tokens become control ones; the EOG set (llama.cpp's rules)."""
    by_text: dict[str, int] = {}
    for i, tok in enumerate(vocab.tokens):
        by_text.setdefault(tok, i)
    ids, types = vocab.special_ids, vocab.types
    for name, texts in (("eot", EOT_TEXTS), ("eom", ("<|eom_id|>",)), *FIM_TEXTS.items()):
        if name not in ids:
            found = _first_with_text(vocab, by_text, texts)
            if found is not None:
                ids[name] = found
                types[found] = CONTROL
    eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if k in ids}
    for text in EOG_TEXTS:
        tid = by_text.get(text)
        if tid is not None:
            eog.add(tid)
            types[tid] = CONTROL
    for text in _ALWAYS_RENDERED:
        if text in by_text:
            types[by_text[text]] = USER_DEFINED
    eog.update(ids[k] for k in ("eos", "eot", "eom") if k in ids)
    eog_text = {vocab.tokens[i]: i for i in eog}
    if "<|end|>" in eog_text and ("<|call|>" in eog_text or "<|calls|>" in eog_text) and (
        "<|return|>" in eog_text or "<|flush|>" in eog_text
    ):
        eog.discard(eog_text["<|end|>"])
        types[eog_text["<|end|>"]] = USER_DEFINED
    if "<|tool_response>" in eog_text and "</s>" in eog_text:
        eog.discard(eog_text["</s>"])
        types[eog_text["</s>"]] = NORMAL
    vocab.eog_ids = eog


def _strip_attributes(vocab: Vocab, metadata: Mapping[str, Any]) -> None:
    """llama.cpp's per-model lstrip/rstrip attributes of special tokens."""
    name = str(metadata.get("general.name", "")).lower()
    pre = vocab.pre or ""
    arch = str(metadata.get("general.architecture", ""))
    by_text = {t: i for i, t in enumerate(vocab.tokens)}
    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
    ):
        if "<mask>" in by_text:
            vocab.lstrip.add(by_text["<mask>"])
    elif "phi-3" in name or "phi3" in name:
        vocab.rstrip.update(vocab.special_tokens())
        if "</s>" in by_text:
            vocab.rstrip.add(by_text["</s>"])
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            vocab.rstrip.discard(by_text.get(text, -1))
    elif "modern-bert" in name and "[MASK]" in by_text:
        vocab.lstrip.add(by_text["[MASK]"])
