"""The Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper``, and how
afm encodes long texts with it.

``mlx_lm.load`` returns a ``TokenizerWrapper`` that forwards most attributes
to the Hugging Face tokenizer it wraps, but code that needs the tokenizer
object itself (llguidance's ``from_tokenizer``, per-tokenizer caches, added
vocabularies) has only the wrapper's private ``_tokenizer`` field to reach it.

:func:`encode` is ``tokenizer.encode`` for texts of any length with a bounded
cost: a long text is encoded in pieces of about :data:`CHUNK_CHARS`
characters, cut only where the tokenizer itself splits (checked on the text
around each cut: the tokens of the two sides joined must be the tokens of
the whole), so the ids are the ones one call would give, while memory stays
that of one piece (one call on 8 MB took 1.6 GB), and a ``check`` callback
between pieces can stop the work (a token budget, a client that left, a
deadline).  :func:`special_spellings` lists the special tokens' texts (what
must never come from a client's text).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["CHUNK_CHARS", "drop_token_map", "encode", "hf_tokenizer", "special_spellings"]

CHUNK_CHARS = 16384
"""Characters per piece of a long text (:func:`encode`)."""

_SEAM_WINDOW = 256
"""Characters on each side of a cut that must tokenize the same cut or whole."""

_SEAM_SEARCH = 4096
"""How far before a piece's end a cut is looked for."""

_LOCK = threading.Lock()
_SPECIALS: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer ``tokenizer`` wraps, or ``tokenizer`` itself
    when it is not an mlx-lm wrapper."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def drop_token_map(tokenizer: Any) -> None:
    """Give an mlx-lm wrapper the streaming detokenizer that keeps no table.

    ``TokenizerWrapper`` builds its ``detokenizer`` when it is made: for a
    byte-level vocabulary (``BPEStreamingDetokenizer``) a list of every
    token's text, 3.4 MiB on SmolLM2's 49k tokens, 10 on Qwen's 151k.  afm
    detokenizes with its own tables (:mod:`afm_core._stream.detok`), so the
    wrapper's is only for host code asking ``tokenizer.detokenizer``: it
    gets mlx-lm's ``NaiveStreamingDetokenizer`` (the tokenizer's own decode;
    same text, more work per token)."""
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, TokenizerWrapper

    if isinstance(tokenizer, TokenizerWrapper) and \
            not isinstance(tokenizer._detokenizer, NaiveStreamingDetokenizer):
        tokenizer._detokenizer = NaiveStreamingDetokenizer(tokenizer._tokenizer)


def special_spellings(tokenizer: Any) -> frozenset[str]:
    """The texts of the vocabulary's special tokens (the added tokens marked
    special: ``<|im_start|>``, ``<|eot_id|>``; not Qwen's ``<tool_call>``):
    the ones ``split_special_tokens`` keeps as text."""
    hf = hf_tokenizer(tokenizer)
    try:
        with _LOCK:
            found = _SPECIALS.get(hf)
    except TypeError:  # (not weakly referenceable)
        found = None
    if found is not None:
        return found
    spellings: set[str] = set()
    decoder = getattr(hf, "added_tokens_decoder", None)
    if isinstance(decoder, dict):
        spellings = {str(t.content) for t in decoder.values() if getattr(t, "special", False)}
    for name in ("all_special_tokens",):
        spellings.update(str(t) for t in getattr(hf, name, None) or ())
    result = frozenset(s for s in spellings if s)
    try:
        with _LOCK:
            _SPECIALS[hf] = result
    except TypeError:
        pass
    return result


def _encode_once(tokenizer: Any, text: str, parse_special: bool, add_special_tokens: bool) -> list[int]:
    if parse_special:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))


def encode(tokenizer: Any, text: str, *, parse_special: bool = True, add_special_tokens: bool = False,
           check: Callable[[int], None] | None = None) -> list[int]:
    """``text``'s token ids, as ``tokenizer.encode`` gives them (special-token
    spellings become their tokens unless ``parse_special`` is False; what the
    tokenizer adds around a text, with ``add_special_tokens``), in pieces for
    a long text.  ``check(n)`` is called with the count of ids so far before
    each piece and at the end; what it raises stops the work."""
    if len(text) <= CHUNK_CHARS + _SEAM_SEARCH:
        if check is not None:
            check(0)
        ids = _encode_once(tokenizer, text, parse_special, add_special_tokens)
        if check is not None:
            check(len(ids))
        return ids
    ids = []
    start = 0
    while start < len(text):
        if check is not None:
            check(len(ids))
        end = _cut(tokenizer, text, start, parse_special)
        ids += _encode_once(tokenizer, text[start:end], parse_special, False)
        start = end
    if add_special_tokens:
        ids = _with_added(tokenizer, text, ids, parse_special)
    if check is not None:
        check(len(ids))
    return ids


def _cut(tokenizer: Any, text: str, start: int, parse_special: bool) -> int:
    """Where the piece beginning at ``start`` ends: the last checked cut before
    ``start + CHUNK_CHARS`` (the text's end when little is left, or when no cut
    checks out: then the piece runs on to the next one that does)."""
    end = start + CHUNK_CHARS
    while end + _SEAM_SEARCH < len(text):
        for p in _candidates(text, end - _SEAM_SEARCH, end):
            if p - _SEAM_WINDOW > start and _seam_holds(tokenizer, text, p, parse_special):
                return p
        end += CHUNK_CHARS  # no cut here: a longer piece
    return len(text)


def _candidates(text: str, lo: int, hi: int) -> list[int]:
    """Cut positions in ``[lo, hi)``, latest first: after a line break that
    follows text (``x\n|Y``), then before a space that does (``x| Y``)."""
    lines: list[int] = []
    spaces: list[int] = []
    for p in range(hi - 1, max(lo, 2), -1):
        if text[p].isspace() or text[p - 2].isspace():
            continue  # a cut goes between text and text, one break or space apart
        if text[p - 1] == "\n":
            lines.append(p)
            if len(lines) == 4:
                break
        elif text[p - 1] == " " and len(spaces) < 8:
            spaces.append(p - 1)
    return lines + spaces


def _seam_holds(tokenizer: Any, text: str, p: int, parse_special: bool) -> bool:
    left = text[p - _SEAM_WINDOW:p]
    right = text[p:p + _SEAM_WINDOW]
    whole = _encode_once(tokenizer, left + right, parse_special, False)
    return whole == _encode_once(tokenizer, left, parse_special, False) + \
        _encode_once(tokenizer, right, parse_special, False)


def _with_added(tokenizer: Any, text: str, ids: list[int], parse_special: bool) -> list[int]:
    """``ids`` with what ``add_special_tokens`` puts around a text (a BOS in
    front, an EOS behind), as the tokenizer adds them to a short sample of it."""
    sample = text[:64]
    bare = _encode_once(tokenizer, sample, parse_special, False)
    full = _encode_once(tokenizer, sample, parse_special, True)
    for lead in range(len(full) - len(bare) + 1):
        if full[lead:lead + len(bare)] == bare:
            return full[:lead] + ids + full[lead + len(bare):]
    return ids
