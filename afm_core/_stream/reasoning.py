"""Reasoning splitter: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from .twins import load_twin

_impl = load_twin("afm_core._stream.reasoning_c", "afm_core._stream.reasoning_py")
COMPILED: bool = _impl.__name__.endswith("_c")  # the Cython build is in use

ReasoningSplitter = _impl.ReasoningSplitter

__all__ = ["ReasoningSplitter"]
