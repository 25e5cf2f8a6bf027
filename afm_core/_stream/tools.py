"""Tool-call fragment tracker: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from .twins import load_twin

_impl = load_twin("afm_core._stream.tools_c", "afm_core._stream.tools_py")
COMPILED: bool = _impl.__name__.endswith("_c")  # the Cython build is in use

ToolCallTracker = _impl.ToolCallTracker

__all__ = ["ToolCallTracker"]
