"""Incremental detokenizer: the Cython build unless disabled or absent, else the pure twin.

How the twin is chosen, and what a broken build does: :mod:`.twins`.
"""

from __future__ import annotations

from .twins import NO_EXTENSIONS, build_unusable

COMPILED = False  # whether the Cython build is in use
if not NO_EXTENSIONS:
    try:
        from . import detok_c as _twin
    except ImportError as exc:
        build_unusable("afm_core._stream.detok_c", exc)
    else:
        COMPILED = True
if not COMPILED:
    from . import detok_py as _twin  # type: ignore[no-redef]

DecoderTables = _twin.DecoderTables
IncrementalDetokenizer = _twin.IncrementalDetokenizer

__all__ = ["DecoderTables", "IncrementalDetokenizer"]
