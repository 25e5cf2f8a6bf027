"""Incremental detokenizer: token ids in, text deltas out (pure twin).

Concatenating every :meth:`IncrementalDetokenizer.feed` result and the final
:meth:`~IncrementalDetokenizer.flush` gives exactly
``tokenizer.decode(ids, skip_special_tokens=...)`` (the ``tokenizers``
backend decode, without transformers' ``clean_up_tokenization_spaces``).

* byte-level: an incomplete UTF-8 sequence is held back (at most 3 bytes);
  invalid bytes become U+FFFD as soon as they are known to be invalid.
* sentencepiece: a run of ``<0xNN>`` byte tokens is held until the next
  text token (or ``flush``), since ``ByteFallback`` turns the whole run into
  U+FFFD per byte when any of it is invalid; valid text tokens are emitted
  at once.  The decoder's leading ``Strip`` applies to the first text.

Work per token is O(1) amortised: a table lookup, and for held-back bytes a
decode of at most the held bytes.
"""

from __future__ import annotations

from codecs import utf_8_decode
from collections.abc import Iterable
from typing import Any

from .detok_tables import BYTE, RAW, SKIP, TEXT, DecoderTables

__all__ = ["DecoderTables", "IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Stream-decode one sequence; build ``tables`` once per tokenizer and share them."""

    def __init__(self, tables: DecoderTables | Any, *, skip_special_tokens: bool = True) -> None:
        if not isinstance(tables, DecoderTables):
            tables = DecoderTables.from_tokenizer(tables, skip_special_tokens=skip_special_tokens)
        self.tables = tables
        self._spm = tables.mode == "sentencepiece"
        self._kinds = tables.kinds
        self._texts = tables.texts
        self._raws = tables.raws
        self._size = len(tables.kinds)
        self.reset()

    def reset(self) -> None:
        """Forget the stream (keep the tables)."""
        self._pending = b""  # byte-level: an incomplete UTF-8 tail
        self._run = bytearray()  # sentencepiece: the open byte-fallback run
        self._first = True
        self._strip_left = self.tables.strip_count

    def feed(self, token_id: int) -> str:
        """The text that ``token_id`` completes (often all of it, maybe "")."""
        if not 0 <= token_id < self._size:
            return ""
        kind = self._kinds[token_id]
        if kind == SKIP:
            return ""
        if self._spm:
            if kind == BYTE:
                self._first = False
                self._run.append(self.tables.bytevals[token_id])
                return ""
            text = self._texts[token_id]
            assert text is not None
            if self._first:
                self._first = False
                text = self.tables.first_texts.get(token_id, text)
            if self._run:
                text = self._close_run() + text
            return self._strip(text) if self._strip_left else text
        if kind == TEXT and not self._pending:
            return self._texts[token_id]  # type: ignore[return-value]
        if kind == RAW:
            raw = self._raws[token_id]
        else:  # a TEXT id after held-back bytes: its bytes are its text's UTF-8
            own = self._texts[token_id]
            raw = own.encode() if own is not None else None
        assert raw is not None
        data = self._pending + raw
        text, used = utf_8_decode(data, "replace", False)
        self._pending = data[used:]
        return text

    def feed_many(self, token_ids: Iterable[int]) -> str:
        """The text completed by several tokens."""
        return "".join([self.feed(t) for t in token_ids])

    def flush(self) -> str:
        """End of stream: whatever was held back (U+FFFD for incomplete bytes)."""
        if self._spm:
            text = self._close_run() if self._run else ""
            return self._strip(text) if self._strip_left else text
        text = self._pending.decode("utf-8", "replace")
        self._pending = b""
        return text

    def _close_run(self) -> str:
        run = bytes(self._run)
        self._run.clear()
        try:
            return run.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(run)

    def _strip(self, text: str) -> str:
        limit = self._strip_left
        char = self.tables.strip_char
        n = len(text)
        k = 0
        while k < limit and k < n and text[k] == char:
            k += 1
        if k == n and k < limit:
            self._strip_left -= k
        elif n:
            self._strip_left = 0
        return text[k:]
