"""Helpers shared by the benchmark scripts.

Import it before mlx: it imports ``afm_core`` first, which binds MLX's BLAS
calls to OpenBLAS (``afm_core._mlx.blas``); ``libmlx`` binds at load, so a
script that imported ``mlx`` first would measure the reference BLAS.
"""

from __future__ import annotations

import afm_core  # noqa: F401  (first of all: see above)

# isort: split
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["load_model", "median_seconds", "model_path", "paired_rates"]


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_path(spec: str, work: Path) -> Path:
    """A ``--model`` choice as a directory: ``random`` (a fresh random tiny
    test model under ``work``), ``default`` (afm's default model) or a path."""
    if spec == "random":
        from afm_core.testing import make_random_model

        return make_random_model(work / "random")
    if spec == "default":
        from afm_core import resolve_model

        return Path(resolve_model(None))
    return Path(spec)


def load_model(path: Path | None) -> tuple[Any, Any, Path]:
    """``mlx_lm.load`` of ``path``, or of a fresh random tiny test model when None."""
    import mlx_lm

    from afm_core.testing import make_random_model

    path = path or make_random_model(Path(tempfile.mkdtemp()) / "tiny")
    model, tok = mlx_lm.load(str(path))
    return model, tok, path


def paired_rates(repeats: int, base: Callable[[], tuple[float, Any]],
                 other: Callable[[], tuple[float, Any]], what: str) -> str:
    """Run ``base`` then ``other`` (each returning a rate and its output)
    ``repeats`` times, alternating; both must give the same output.  Returns
    "base-median other-median median-ratio (paired ratios ...)" as columns."""
    pairs = []
    for _ in range(repeats):
        b_rate, b_out = base()
        o_rate, o_out = other()
        if o_out != b_out:
            raise SystemExit(f"{what} gave different tokens")
        pairs.append((b_rate, o_rate))
    ratios = sorted(o / b for b, o in pairs)
    return (f"{statistics.median(b for b, _ in pairs):>12.1f} "
            f"{statistics.median(o for _, o in pairs):>12.1f} {statistics.median(ratios):>6.3f}   "
            f"(paired ratios {', '.join(f'{x:.2f}' for x in ratios)})")
