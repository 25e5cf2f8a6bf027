"""Per-stream token pipeline: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from .twins import load_twin

_impl = load_twin("afm_core._stream.pipeline_c", "afm_core._stream.pipeline_py")
COMPILED: bool = _impl.__name__.endswith("_c")  # the Cython build is in use

StreamPipeline = _impl.StreamPipeline

__all__ = ["StreamPipeline"]
