"""Reasoning splitter: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from ._compat import load_twin

_impl = load_twin("afm_core._reasoning_c", "afm_core._reasoning_py")

ReasoningSplitter = _impl.ReasoningSplitter

__all__ = ["ReasoningSplitter"]
