"""Incremental detokenizer: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from .twins import load_twin

_impl = load_twin("afm_core._stream.detok_c", "afm_core._stream.detok_py")
COMPILED: bool = _impl.__name__.endswith("_c")  # the Cython build is in use

DecoderTables = _impl.DecoderTables
IncrementalDetokenizer = _impl.IncrementalDetokenizer

__all__ = ["DecoderTables", "IncrementalDetokenizer"]
