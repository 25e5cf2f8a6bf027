"""Per-request records and per-run summaries, shared by served and raw runs.

Times in ``RequestResult`` are seconds on ``time.perf_counter``'s clock;
summaries convert latencies to milliseconds (keys end in ``_ms``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ._stats import summarize


@dataclass(slots=True)
class RequestResult:
    """What one request did, as seen by the client (or the raw loop)."""

    index: int
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    detail: str | None = None
    profile: dict[str, Any] | None = None
    text: str | None = None  # the generated text (only when the target keeps it)
    timings: dict[str, Any] | None = None  # the server's own timings (llama.cpp's), if sent

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class RunResult:
    """One load level against one target."""

    target: str
    mode: str  # "closed" or "open"
    level: float  # concurrency (closed) or request rate in req/s (open)
    duration: float
    requests: list[RequestResult]
    truncated: bool = False  # the level's time budget ran out
    client_cpu_s: float | None = None  # CPU the load generator's process used
    server_cpu_s: float | None = None  # CPU the server's process used (where known)
    round: int = 0  # which run of this level (see BenchConfig.rounds)

    @property
    def label(self) -> str:
        return f"c={int(self.level)}" if self.mode == "closed" else f"rate={self.level:g}/s"

    @classmethod
    def pooled(cls, runs: list[RunResult]) -> RunResult:
        """Several rounds of one level on one target as one run: their
        requests together over their summed wall time."""
        first = runs[0]

        def total(values: list[float | None]) -> float | None:
            return None if None in values else math.fsum(v for v in values if v is not None)

        return cls(first.target, first.mode, first.level, math.fsum(r.duration for r in runs),
                   [q for r in runs for q in r.requests], truncated=any(r.truncated for r in runs),
                   client_cpu_s=total([r.client_cpu_s for r in runs]),
                   server_cpu_s=total([r.server_cpu_s for r in runs]))

    def summary(self) -> dict[str, Any]:
        """The figures the report shows, as plain JSON-able values."""
        ok = [r for r in self.requests if r.ok]
        errors = Counter(r.error for r in self.requests if r.error is not None)
        tokens = sum(r.output_tokens for r in ok)
        dur = self.duration if self.duration > 0 else math.nan
        tpot = [
            (r.e2e - r.ttft) / (r.output_tokens - 1)
            for r in ok
            if r.e2e is not None and r.ttft is not None and r.output_tokens > 1
        ]

        def ms(values: list[float]) -> dict[str, Any]:
            return summarize(v * 1000.0 for v in values).as_dict()

        return {
            "target": self.target,
            "mode": self.mode,
            "level": self.level,
            "duration_s": _finite(self.duration),
            "truncated": self.truncated,
            "client_cpu_s": self.client_cpu_s,
            "client_cpu_share": (None if self.client_cpu_s is None
                                 else _finite(self.client_cpu_s / dur)),
            "client_cpu_ms_per_token": _per_token(self.client_cpu_s, tokens),
            "server_cpu_s": self.server_cpu_s,
            "server_cpu_ms_per_token": _per_token(self.server_cpu_s, tokens),
            "requests": len(self.requests),
            "ok": len(ok),
            "errors": dict(sorted(errors.items())),
            "error_count": sum(errors.values()),
            "request_throughput": _finite(len(ok) / dur),
            "output_tokens": tokens,
            "output_tokens_per_s": _finite(tokens / dur),
            "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
            "itl_ms": ms([g for r in ok for g in r.itls]),
            "tpot_ms": ms(tpot),
            "e2e_ms": ms([r.e2e for r in ok if r.e2e is not None]),
            "output_tokens_per_request": summarize(r.output_tokens for r in ok).as_dict(),
            "error_details": sorted({f"{r.error}: {r.detail}" for r in self.requests
                                     if r.error is not None and r.detail})[:10],
            "profile": profile_summary(self.requests),
        }


def _per_token(cpu_s: float | None, tokens: int) -> float | None:
    return None if cpu_s is None or tokens <= 0 else cpu_s * 1000.0 / tokens


def _finite(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


def profile_summary(requests: list[RequestResult]) -> dict[str, Any] | None:
    """Captured ``X-AFM-Profile`` objects: count, the mean of every numeric
    summary field, and the first object (samples cut to 50)."""
    profiles = [r.profile for r in requests if r.profile is not None]
    if not profiles:
        return None
    sums: dict[str, list[float]] = {}
    for p in profiles:
        body = p.get("afm_profile_extended") or p.get("afm_profile") or {}
        summary = body.get("summary", body) if isinstance(body, dict) else {}
        for k, v in summary.items() if isinstance(summary, dict) else ():
            if isinstance(v, int | float) and not isinstance(v, bool):
                sums.setdefault(k, []).append(float(v))
    first = dict(profiles[0])
    ext = first.get("afm_profile_extended")
    if isinstance(ext, dict) and isinstance(ext.get("samples"), list):
        first["afm_profile_extended"] = {**ext, "samples": ext["samples"][:50]}
    return {
        "captured": len(profiles),
        "summary_mean": {k: math.fsum(v) / len(v) for k, v in sorted(sums.items())},
        "first": first,
    }
