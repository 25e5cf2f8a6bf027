"""Tool-call fragment tracker: the Cython build unless disabled or absent, else the pure twin.

How the twin is chosen, and what a broken build does: :mod:`.twins`.
"""

from __future__ import annotations

from .twins import NO_EXTENSIONS, build_unusable

COMPILED = False  # whether the Cython build is in use
if not NO_EXTENSIONS:
    try:
        from . import tools_c as _twin
    except ImportError as exc:
        build_unusable("afm_core._stream.tools_c", exc)
    else:
        COMPILED = True
if not COMPILED:
    from . import tools_py as _twin  # type: ignore[no-redef]

ToolCallTracker = _twin.ToolCallTracker

__all__ = ["ToolCallTracker"]
