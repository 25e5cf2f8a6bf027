"""Tool-call fragment tracker: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from ._compat import load_twin

_impl = load_twin("afm_core._tools_c", "afm_core._tools_py")

ToolCallTracker = _impl.ToolCallTracker

__all__ = ["ToolCallTracker"]
