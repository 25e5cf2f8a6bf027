"""Per-stream token pipeline: the Cython build unless disabled, else the pure twin."""

from __future__ import annotations

from ._compat import load_twin

_impl = load_twin("afm_core._pipeline_c", "afm_core._pipeline_py")

StreamPipeline = _impl.StreamPipeline

__all__ = ["StreamPipeline"]
