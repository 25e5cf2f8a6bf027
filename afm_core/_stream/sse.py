"""SSE frame encoder: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from .twins import load_twin

_impl = load_twin("afm_core._stream.sse_c", "afm_core._stream.sse_py")
COMPILED: bool = _impl.__name__.endswith("_c")  # the Cython build is in use

DONE = _impl.DONE
SSEEncoder = _impl.SSEEncoder
dumps = _impl.dumps
escape_json_string = _impl.escape_json_string
frame = _impl.frame

__all__ = ["DONE", "SSEEncoder", "dumps", "escape_json_string", "frame"]
