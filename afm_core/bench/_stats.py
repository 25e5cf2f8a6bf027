"""Percentiles and summaries over latency samples (pure; no numpy needed).

``percentile`` matches ``numpy.percentile(..., method="linear")``, the
default, so figures agree with anything computed offline from the JSON.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

QUANTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN if empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


@dataclass(frozen=True, slots=True)
class Summary:
    """Count, mean, extremes and the usual percentiles of one sample set."""

    count: int
    mean: float
    min: float
    p50: float
    p90: float
    p99: float
    max: float

    def as_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}


def summarize(values: Iterable[float]) -> Summary:
    """Summary of ``values``; every figure is NaN when there are none."""
    xs = sorted(float(v) for v in values)
    if not xs:
        nan = math.nan
        return Summary(0, nan, nan, nan, nan, nan, nan)
    return Summary(
        count=len(xs),
        mean=math.fsum(xs) / len(xs),
        min=xs[0],
        p50=percentile(xs, 50.0),
        p90=percentile(xs, 90.0),
        p99=percentile(xs, 99.0),
        max=xs[-1],
    )


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing, NaN, or ``den`` is 0."""
    if num is None or den is None:
        return None
    if math.isnan(num) or math.isnan(den) or den == 0.0:
        return None
    return num / den
