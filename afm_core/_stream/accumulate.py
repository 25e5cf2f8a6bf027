"""Chunk accumulator: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from .twins import load_twin

_impl = load_twin("afm_core._stream.accumulate_c", "afm_core._stream.accumulate_py")
COMPILED: bool = _impl.__name__.endswith("_c")  # the Cython build is in use

ChunkAccumulator = _impl.ChunkAccumulator
accumulate = _impl.accumulate

__all__ = ["ChunkAccumulator", "accumulate"]
