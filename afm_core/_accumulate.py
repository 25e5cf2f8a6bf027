"""Chunk accumulator: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from ._compat import load_twin

_impl = load_twin("afm_core._accumulate_c", "afm_core._accumulate_py")

ChunkAccumulator = _impl.ChunkAccumulator
accumulate = _impl.accumulate

__all__ = ["ChunkAccumulator", "accumulate"]
