"""Per-token decode tables for the incremental detokenizer (shared by both twins).

Built once per tokenizer from its ``tokenizer.json`` decoder config:

* ``byte_level`` (GPT-2 / Qwen / Llama-3 ``ByteLevel``): every token maps to
  raw bytes through the byte-to-unicode table (a token with a char outside
  the table, like an added token with a space, uses its own UTF-8, as the HF
  decoder does); the text is ``bytes.decode("utf-8", "replace")``.
* ``sentencepiece``: a ``Sequence`` of per-token ``Replace`` (string
  pattern) / ``Metaspace`` steps, then optional ``ByteFallback``, ``Fuse``
  and ``Strip(start=k, stop=0)`` (Llama, Mistral, Gemma), or a bare
  ``Metaspace``.  ``<0xNN>`` tokens are raw bytes; a run of them decodes as
  UTF-8 or, if invalid, to one U+FFFD per byte token, like ``ByteFallback``.

Anything else raises :class:`afm_core._errors.UnsupportedDecoderError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .._errors import UnsupportedDecoderError

__all__ = [
    "BYTE",
    "RAW",
    "SKIP",
    "TEXT",
    "DecoderTables",
    "backend_tokenizer",
    "byte_decoder",
]

# Token kinds.
SKIP = 0  # dropped (skipped special token or unknown id)
TEXT = 1  # ``texts[id]`` is the token's standalone text
RAW = 2  # byte_level: ``raws[id]`` is not valid UTF-8 on its own (only RAW ids keep their bytes)
BYTE = 3  # sentencepiece: a ``<0xNN>`` byte-fallback token, value ``bytevals[id]``


def byte_decoder() -> dict[str, int]:
    """GPT-2's unicode-char -> byte map (the inverse of ``bytes_to_unicode``)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def backend_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a HF fast tokenizer or mlx-lm wrapper."""
    from tokenizers import Tokenizer

    obj = tokenizer
    for _ in range(4):
        if isinstance(obj, Tokenizer):
            return obj
        nxt = getattr(obj, "backend_tokenizer", None)
        if nxt is None:
            nxt = getattr(obj, "_tokenizer", None)
        if nxt is None or nxt is obj:
            break
        obj = nxt
    raise UnsupportedDecoderError(
        f"{type(tokenizer).__name__} has no `tokenizers` backend (a fast tokenizer is required)"
    )


def _byte_token(token: str) -> int:
    """The byte of a ``<0xNN>`` token (as ``ByteFallback`` parses it), else -1."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        digits = token[3:5]
        body = digits[1:] if digits[0] == "+" else digits
        if body and all(c in "0123456789abcdefABCDEF" for c in body):
            return int(body, 16)
    return -1


def _metaspace_scheme(step: dict[str, Any]) -> bool:
    """Whether a ``Metaspace`` decoder drops the replacement in the first token."""
    scheme = step.get("prepend_scheme")
    if scheme is None:
        return bool(step.get("add_prefix_space", True))
    return scheme != "never"


@dataclass(slots=True)
class _SPMPlan:
    steps: list[tuple[str, str, bool]] = field(default_factory=list)  # (pattern, content, first-drops)
    byte_fallback: bool = False
    strip_char: str = " "
    strip_count: int = 0


def _spm_plan(decoder: dict[str, Any]) -> _SPMPlan:
    steps = decoder["decoders"] if decoder.get("type") == "Sequence" else [decoder]
    plan = _SPMPlan()
    phase = 0  # 0: per-token steps, 1: after ByteFallback, 2: after Fuse, 3: after Strip
    for step in steps:
        kind = step.get("type")
        if kind == "Replace" and phase == 0:
            pattern = step.get("pattern", {})
            if "String" not in pattern:
                raise UnsupportedDecoderError(f"unsupported Replace pattern {pattern!r}")
            plan.steps.append((pattern["String"], step["content"], False))
        elif kind == "Metaspace" and phase == 0:
            plan.steps.append((step.get("replacement", "▁"), " ", _metaspace_scheme(step)))
        elif kind == "ByteFallback" and phase == 0:
            plan.byte_fallback = True
            phase = 1
        elif kind == "Fuse" and phase < 2:
            phase = 2
        elif kind == "Strip" and phase == 2 and not step.get("stop", 0):
            plan.strip_char = step.get("content", " ")
            plan.strip_count = int(step.get("start", 0))
            phase = 3
        else:
            raise UnsupportedDecoderError(f"unsupported decoder step {step!r} in {decoder!r}")
    if not plan.steps and not plan.byte_fallback:
        raise UnsupportedDecoderError(f"unsupported decoder {decoder!r}")
    return plan


def _apply(steps: list[tuple[str, str, bool]], token: str, first: bool) -> str:
    for pattern, content, first_drops in steps:
        token = token.replace(pattern, "" if first and first_drops else content)
    return token


@dataclass(frozen=True, slots=True)
class DecoderTables:
    """Everything a detokenizer needs, precomputed per token id."""

    mode: str  # "byte_level" | "sentencepiece"
    kinds: bytes  # SKIP / TEXT / RAW / BYTE per id
    texts: list[str | None]
    raws: list[bytes | None]  # byte_level RAW ids only (a TEXT id's bytes are its text's UTF-8)
    bytevals: bytes  # sentencepiece byte tokens
    first_texts: dict[int, str]  # sentencepiece: first-token variants that differ
    strip_char: str = " "
    strip_count: int = 0

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, skip_special_tokens: bool = True) -> DecoderTables:
        """Build from a ``tokenizers.Tokenizer``, HF fast tokenizer or mlx-lm wrapper."""
        backend = backend_tokenizer(tokenizer)
        # the decoder's and the added tokens' configs only: parsing the whole
        # tokenizer.json (its merges) for them left megabytes in the heap
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else None
        if not isinstance(decoder, dict):
            raise UnsupportedDecoderError(f"tokenizer has no decoder ({decoder!r})")
        added = backend.get_added_tokens_decoder()
        special = {a.content for a in added.values() if a.special} if skip_special_tokens else set()
        size = max([backend.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])
        tokens: list[str | None] = [backend.id_to_token(i) for i in range(size)]
        if decoder.get("type") == "ByteLevel" or (
            decoder.get("type") == "Sequence"
            and [d.get("type") for d in decoder.get("decoders", [])] == ["ByteLevel"]
        ):
            return cls._byte_level(tokens, special)
        return cls._sentencepiece(tokens, special, _spm_plan(decoder))

    @classmethod
    def _byte_level(cls, tokens: list[str | None], special: set[str]) -> DecoderTables:
        table = byte_decoder()
        kinds = bytearray(len(tokens))
        texts: list[str | None] = [None] * len(tokens)
        raws: list[bytes | None] = [None] * len(tokens)
        for i, token in enumerate(tokens):
            if token is None or token in special:
                continue
            try:
                raw = bytes(table[c] for c in token)
            except KeyError:
                raw = token.encode("utf-8")
            try:
                texts[i] = raw.decode("utf-8")
                kinds[i] = TEXT
            except UnicodeDecodeError:
                raws[i] = raw
                kinds[i] = RAW
        return cls("byte_level", bytes(kinds), texts, raws, bytes(len(tokens)), {})

    @classmethod
    def _sentencepiece(cls, tokens: list[str | None], special: set[str], plan: _SPMPlan) -> DecoderTables:
        kinds = bytearray(len(tokens))
        texts: list[str | None] = [None] * len(tokens)
        bytevals = bytearray(len(tokens))
        first_texts: dict[int, str] = {}
        for i, token in enumerate(tokens):
            if token is None or token in special:
                continue
            text = _apply(plan.steps, token, False)
            value = _byte_token(text) if plan.byte_fallback else -1
            if value >= 0:
                kinds[i] = BYTE
                bytevals[i] = value
                continue
            kinds[i] = TEXT
            texts[i] = text
            first = _apply(plan.steps, token, True)
            if first != text:
                first_texts[i] = first
        return cls(
            "sentencepiece",
            bytes(kinds),
            texts,
            [None] * len(tokens),
            bytes(bytevals),
            first_texts,
            plan.strip_char,
            plan.strip_count,
        )
