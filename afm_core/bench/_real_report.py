"""The real-model report: afm, raw mlx-lm and ``mlx_lm.server`` against llama.cpp.

Four headline figures per target, each also as a ratio to llama.cpp's from
the same run (``x llama.cpp``):

* ``decode_tok_s``: single-stream decode speed, one request at a time (the
  ``decode`` phase): the median over requests of ``(tokens - 1) / (end -
  first token)``, so the prompt's prefill is left out;
* ``batch_tok_s``: aggregate output tokens/s with 8 streams at once (the
  ``batch`` phase), over the level's wall time;
* ``ttft_p50_ms``: median time to first token for a ~512-token prompt, one
  request at a time (the ``ttft`` phase);
* ``peak_rss_mib``: the server process's peak resident set (``VmHWM``) at the
  end of the run; for raw it is the benchmark's own process (the harness and
  every client besides the model), so only roughly comparable.

With several rounds, the tokens/s ratios are the medians of the rounds'
paired ratios (as in ``afm bench``); TTFT and RSS ratios are of the pooled
figures.  Higher is better for tokens/s, lower for TTFT and RSS.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ._report import run_footer, write_report
from ._results import RunResult
from ._stats import ratio

LLAMACPP = "llama.cpp"

#: (key, column title, format, higher is better)
HEADLINE: tuple[tuple[str, str, str, bool], ...] = (
    ("decode_tok_s", "decode tok/s", ".1f", True),
    ("batch_tok_s", "C=8 tok/s", ".1f", True),
    ("ttft_p50_ms", "TTFT p50 ms", ".0f", False),
    ("peak_rss_mib", "peak RSS MiB", ".0f", False),
)


def decode_rates(run: RunResult) -> list[float]:
    """Each successful request's decode speed: tokens after the first over
    the time after the first (tokens/s)."""
    out = []
    for r in run.requests:
        if r.ok and r.e2e is not None and r.ttft is not None and r.output_tokens > 1:
            span = r.e2e - r.ttft
            if span > 0:
                out.append((r.output_tokens - 1) / span)
    return out


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _phase_value(key: str, runs: Sequence[RunResult]) -> float | None:
    """A headline figure from one phase's runs (pooled when several)."""
    if not runs:
        return None
    if key == "decode_tok_s":
        return _median([x for run in runs for x in decode_rates(run)])
    pooled = RunResult.pooled(list(runs)).summary()
    if key == "batch_tok_s":
        value = pooled["output_tokens_per_s"]
        return None if value is None else float(value)
    if key == "ttft_p50_ms":
        value = pooled["ttft_ms"]["p50"]
        return None if value is None else float(value)
    raise KeyError(key)


_PHASE_OF = {"decode_tok_s": "decode", "batch_tok_s": "batch", "ttft_p50_ms": "ttft"}


def _paired_ratio(key: str, mine: dict[int, RunResult], base: dict[int, RunResult]) -> \
        tuple[float | None, list[float | None]]:
    """Median over rounds of this round's figure over the base's."""
    by_round = [ratio(_phase_value(key, [mine[r]]), _phase_value(key, [base[r]]))
                for r in sorted(mine) if r in base]
    known = [x for x in by_round if x is not None]
    return (statistics.median(known) if known else None), by_round


def build_real_report(runs: Iterable[RunResult], *, phases: Sequence[dict[str, Any]],
                      servers: dict[str, dict[str, Any]], meta: dict[str, Any],
                      config: dict[str, Any], skipped: dict[str, str],
                      baseline: str = LLAMACPP) -> dict[str, Any]:
    """The report as a JSON-able dict.

    ``runs`` carry their phase name in ``mode`` (``decode``, ``batch``,
    ``ttft``) and their round in ``round``; ``phases`` describe the phases
    (name, title, concurrency, requests, max_tokens, prompt tokens);
    ``servers`` holds per target ``peak_rss_bytes`` and ``blas`` when known.
    """
    grouped: dict[str, dict[str, dict[int, RunResult]]] = {}
    targets: list[str] = []
    for run in runs:
        if run.target not in targets:
            targets.append(run.target)
        grouped.setdefault(run.mode, {}).setdefault(run.target, {})[run.round] = run
    for name in servers:
        if name not in targets:
            targets.append(name)
    phase_out = []
    for ph in phases:
        by_target: dict[str, Any] = {}
        for target, rounds in grouped.get(ph["name"], {}).items():
            order = sorted(rounds)
            s = RunResult.pooled([rounds[r] for r in order]).summary()
            s["rounds"] = len(order)
            s["output_tokens_per_s_by_round"] = [rounds[r].summary()["output_tokens_per_s"]
                                                 for r in order]
            rates = [x for r in order for x in decode_rates(rounds[r])]
            s["decode_tok_s_p50"] = _median(rates)
            by_target[target] = s
        phase_out.append({**ph, "by_target": by_target})

    headline: dict[str, dict[str, Any]] = {}
    for target in targets:
        h: dict[str, Any] = {}
        for key, _, _, _ in HEADLINE:
            if key == "peak_rss_mib":
                rss = servers.get(target, {}).get("peak_rss_bytes")
                h[key] = None if rss is None else rss / 2**20
            else:
                rounds = grouped.get(_PHASE_OF[key], {}).get(target, {})
                h[key] = _phase_value(key, [rounds[r] for r in sorted(rounds)])
        headline[target] = h
    if baseline in headline:
        base = headline[baseline]
        for target, h in headline.items():
            vs: dict[str, Any] = {}
            for key, _, _, _ in HEADLINE:
                vs[key] = ratio(h[key], base[key])
                phase = _PHASE_OF.get(key)
                if key in ("decode_tok_s", "batch_tok_s") and phase is not None:
                    mine = grouped.get(phase, {}).get(target, {})
                    theirs = grouped.get(phase, {}).get(baseline, {})
                    if len(mine) > 1 and len(theirs) > 1:
                        med, by_round = _paired_ratio(key, mine, theirs)
                        vs[key + "_pooled"] = vs[key]
                        vs[key + "_by_round"] = by_round
                        vs[key] = med
            h[f"vs_{baseline}"] = vs
    return {"mode": "real-model", "baseline": baseline, "meta": meta, "config": config,
            "targets": targets, "skipped": skipped, "phases": phase_out,
            "servers": servers, "headline": headline}


def _fmt(x: float | None, spec: str = ".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _blas_name(blas: Any) -> str:
    if not isinstance(blas, dict):
        return "-"
    name = str(blas.get("name", "?"))
    if blas.get("threads"):
        name += f" {blas['threads']}t"
    return name


def format_real_table(report: dict[str, Any]) -> str:
    """The headline table (one row per target, ratios to the baseline),
    then each phase's details, skips and notes."""
    base = report.get("baseline", LLAMACPP)
    vs_key = f"vs_{base}"
    cols = [(key, title, spec) for key, title, spec, _ in HEADLINE]
    head = f"{'target':<15}" + "".join(f" {title:>12} {'x llama':>7}" for _, title, _ in cols)
    head += "  BLAS"
    lines = [head, "-" * len(head)]
    for target in report["targets"]:
        h = report["headline"].get(target, {})
        vs = h.get(vs_key, {})
        row = f"{target:<15}"
        for key, _, spec in cols:
            row += f" {_fmt(h.get(key), spec):>12} {_fmt(vs.get(key), '.3f'):>7}"
        row += "  " + _blas_name(report.get("servers", {}).get(target, {}).get("blas"))
        lines.append(row)
    lines.append("")
    dh = (f"{'phase':<8} {'target':<15} {'ok':>7} {'tok/s':>8} {'decode':>7} {'TTFT p50':>9} "
          f"{'p90':>7} {'ITL p50':>8} {'E2E p50':>8} {'prompt':>7}  errors")
    lines += [dh, "-" * len(dh)]
    for ph in report["phases"]:
        for target in report["targets"]:
            s = ph["by_target"].get(target)
            if s is None:
                continue
            errs = ",".join(f"{k}={v}" for k, v in s["errors"].items()) or "0"
            if s.get("truncated"):
                errs += " (time budget hit)"
            prompt = ph.get("prompt_tokens_mean")
            lines.append(
                f"{ph['name']:<8} {target:<15} {s['ok']:>3}/{s['requests']:<3} "
                f"{_fmt(s['output_tokens_per_s']):>8} {_fmt(s.get('decode_tok_s_p50')):>7} "
                f"{_fmt(s['ttft_ms']['p50']):>9} {_fmt(s['ttft_ms']['p90']):>7} "
                f"{_fmt(s['itl_ms']['p50'], '.2f'):>8} {_fmt(s['e2e_ms']['p50']):>8} "
                f"{_fmt(prompt, '.0f'):>7}  {errs}")
    lines.append("")
    for ph in report["phases"]:
        lines.append(f"{ph['name']}: {ph.get('title', '')}")
    lines.extend(run_footer(report))
    rounds = (report.get("config") or {}).get("rounds") or 1
    prompt = next((ph.get("prompt_tokens_mean") for ph in report["phases"]
                   if ph["name"] == "ttft"), None)
    lines.append("decode tok/s: 1 stream; C=8 tok/s: aggregate of 8 streams; TTFT p50: "
                 + (f"{prompt:.0f}-token prompts" if prompt else "the long prompts")
                 + "; peak RSS: VmHWM of the server process.")
    lines.append(f"x llama: this target's figure over {base}'s from the same run "
                 "(tokens/s: higher is better; TTFT and RSS: lower is better)"
                 + (f"; tokens/s ratios are medians of {rounds} interleaved rounds' paired ratios."
                    if rounds > 1 else "."))
    lines.append("decode = median per-request (tokens-1)/(end - first token); RSS of raw is the "
                 "benchmark process itself (harness and client included).")
    for note in report.get("notes", []):
        lines.append(note)
    return "\n".join(lines)


def plot_real(report: dict[str, Any], path: Path) -> Path:
    """Four bar charts (the headline figures), each bar labelled with its
    ratio to the baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = report.get("baseline", LLAMACPP)
    targets = list(report["targets"])
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    prompt = next((ph.get("prompt_tokens_mean") for ph in report["phases"]
                   if ph["name"] == "ttft"), None)
    titles = {"decode_tok_s": "single-stream decode tokens/s",
              "batch_tok_s": "aggregate tokens/s, 8 streams",
              "ttft_p50_ms": "TTFT p50 (ms), " + (f"{prompt:.0f}-token prompt" if prompt
                                                  else "long prompt"),
              "peak_rss_mib": "peak RSS of the process (MiB)"}
    for ax, (key, _, spec, better_high) in zip(axes.flat, HEADLINE, strict=True):
        title = titles[key]
        values = [report["headline"].get(t, {}).get(key) for t in targets]
        xs = list(range(len(targets)))
        heights = [0.0 if v is None else float(v) for v in values]
        bars = ax.bar(xs, heights, color=[colors[i % len(colors)] for i in xs])
        for bar, t, v in zip(bars, targets, values, strict=True):
            vs = report["headline"].get(t, {}).get(f"vs_{base}", {}).get(key)
            label = "n/a" if v is None else format(v, spec)
            if vs is not None and t != base:
                label += f"\nx{vs:.2f}"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, targets, fontsize=8)
        ax.set_title(f"{title} ({'higher' if better_high else 'lower'} is better)", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        if any(h > 0 for h in heights):
            ax.set_ylim(0, max(heights) * 1.25)
    model = report.get("meta", {}).get("model", "")
    fig.suptitle(f"afm bench --real-model: {Path(str(model)).name or model} "
                 f"(labels: x {base})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_real_report(report: dict[str, Any], out_dir: Path) -> Sequence[Path]:
    """Write ``report.json``, ``report.txt`` and ``report.png`` to ``out_dir``."""
    return write_report(report, out_dir, table=format_real_table, draw=plot_real)
