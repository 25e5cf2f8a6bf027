"""The Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper``.

``mlx_lm.load`` returns a ``TokenizerWrapper`` that forwards most attributes
to the Hugging Face tokenizer it wraps, but code that needs the tokenizer
object itself (llguidance's ``from_tokenizer``, per-tokenizer caches, added
vocabularies) has only the wrapper's private ``_tokenizer`` field to reach it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["hf_tokenizer"]


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer ``tokenizer`` wraps, or ``tokenizer`` itself
    when it is not an mlx-lm wrapper."""
    return getattr(tokenizer, "_tokenizer", tokenizer)
