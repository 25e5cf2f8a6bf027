"""Incremental detokenizer: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from ._compat import load_twin

_impl = load_twin("afm_core._detok_c", "afm_core._detok_py")

DecoderTables = _impl.DecoderTables
IncrementalDetokenizer = _impl.IncrementalDetokenizer
UnsupportedDecoderError = _impl.UnsupportedDecoderError

__all__ = ["DecoderTables", "IncrementalDetokenizer", "UnsupportedDecoderError"]
