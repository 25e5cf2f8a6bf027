"""SSE frame encoder: the Cython build unless disabled or absent, else the pure twin.

How the twin is chosen, and what a broken build does: :mod:`.twins`.
"""

from __future__ import annotations

from .twins import NO_EXTENSIONS, build_unusable

COMPILED = False  # whether the Cython build is in use
if not NO_EXTENSIONS:
    try:
        from . import sse_c as _twin
    except ImportError as exc:
        build_unusable("afm_core._stream.sse_c", exc)
    else:
        COMPILED = True
if not COMPILED:
    from . import sse_py as _twin  # type: ignore[no-redef]

DONE = _twin.DONE
SSEEncoder = _twin.SSEEncoder
dumps = _twin.dumps
escape_json_string = _twin.escape_json_string
frame = _twin.frame

__all__ = ["DONE", "SSEEncoder", "dumps", "escape_json_string", "frame"]
