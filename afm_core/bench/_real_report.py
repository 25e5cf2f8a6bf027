"""The real-model report: every target against llama.cpp, model by model.

Per model and target, the headline figures (``columns``):

* ``decode_tok_s``: single-stream decode speed (the ``decode`` phase): the
  median over requests of ``(tokens - 1) / (end - first token)``, so the
  prompt's prefill is left out;
* ``batch_tok_s``: aggregate output tokens/s of 8 streams at once (the
  ``batch`` phase), over the level's wall time;
* ``ttft_<L>_ms``: median time to first token of the ``ttft_<L>`` phase's
  long prompts (512, 4k, 16k tokens or the model's context), one at a time;
* ``peak_rss_mib``: the process's peak resident set (``VmHWM``) at the end
  of the model's part; for raw it is the benchmark's own process.

``vs_llama.cpp`` holds each as a ratio to llama.cpp's figure from the same
run, oriented so that **above 1 means better than llama.cpp** for every
speed: tokens/s as ``this / llama.cpp``, time to first token as
``llama.cpp / this``; peak RSS stays ``this / llama.cpp`` (issue 29's bound:
at most 1.3).  With several rounds each speed ratio is the median of the
rounds' paired ratios (``<key>_by_round`` keeps them, ``<key>_pooled`` the
ratio of the pooled figures).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ._llamacpp import LLAMACPP
from ._report import write_report
from ._results import RunResult
from ._stats import ratio

__all__ = ["LLAMACPP", "build_model_report", "columns_for", "decode_rates", "format_real_table",
           "plot_real", "speed_ratio", "write_real_report"]


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


def columns_for(phases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The headline columns of a model: decode, 8 streams, one TTFT per
    TTFT phase, peak RSS.  ``phase``: the phase a column comes from."""
    cols: list[dict[str, Any]] = [{"key": "decode_tok_s", "title": "decode tok/s", "fmt": ".1f", "better": "higher",
             "phase": "decode"},
            {"key": "batch_tok_s", "title": "8-stream tok/s", "fmt": ".1f", "better": "higher",
             "phase": "batch"}]
    for ph in phases:
        if ph.get("kind") == "ttft":
            label = ph["name"].removeprefix("ttft_")
            mean = ph.get("prompt_tokens_mean")
            asked = ph.get("prompt_tokens_requested")
            capped = mean is not None and asked is not None and ph.get("prompt_tokens_target") != asked
            title = f"TTFT {label}" + (f" ({mean:.0f})" if capped else "")
            cols.append({"key": f"{ph['name']}_ms", "title": title, "fmt": ".0f", "better": "lower",
                         "phase": ph["name"]})
    cols.append({"key": "peak_rss_mib", "title": "peak RSS MiB", "fmt": ".0f", "better": "lower",
                 "phase": None})
    return cols


def _value(col: dict[str, Any], runs: Sequence[RunResult]) -> float | None:
    """A headline figure from one phase's runs (pooled when several)."""
    if not runs:
        return None
    if col["key"] == "decode_tok_s":
        return _median([x for run in runs for x in decode_rates(run)])
    pooled = RunResult.pooled(list(runs)).summary()
    if col["key"] == "batch_tok_s":
        value = pooled["output_tokens_per_s"]
    else:
        value = pooled["ttft_ms"]["p50"]
    return None if value is None else float(value)


def speed_ratio(col: dict[str, Any], mine: float | None, base: float | None) -> float | None:
    """``mine`` against ``base``, above 1 when better for a speed (see the
    module docstring); RSS stays ``mine / base``."""
    if col["key"] == "peak_rss_mib" or col["better"] == "higher":
        return ratio(mine, base)
    return ratio(base, mine)


def _phase_details(ph: dict[str, Any], rounds: dict[str, dict[int, RunResult]]) -> dict[str, Any]:
    by_target: dict[str, Any] = {}
    for target, by_round in rounds.items():
        order = sorted(by_round)
        s = RunResult.pooled([by_round[r] for r in order]).summary()
        s["rounds"] = len(order)
        s["output_tokens_per_s_by_round"] = [by_round[r].summary()["output_tokens_per_s"]
                                             for r in order]
        s["decode_tok_s_p50"] = _median([x for r in order for x in decode_rates(by_round[r])])
        counted = [q.prompt_tokens for r in order for q in by_round[r].requests
                   if q.prompt_tokens is not None]
        s["prompt_tokens_mean"] = sum(counted) / len(counted) if counted else None
        by_target[target] = s
    return {**ph, "by_target": by_target}


def _prompt_mismatch(phase: dict[str, Any]) -> str | None:
    """A note when the targets did not see prompts of the same length."""
    means = {t: s["prompt_tokens_mean"] for t, s in phase["by_target"].items()
             if s.get("prompt_tokens_mean") is not None}
    if len(means) < 2:
        return None
    lo, hi = min(means.values()), max(means.values())
    if hi - lo <= 2 + 0.01 * hi:
        return None
    return (f"{phase['name']}: the targets reported different prompt lengths "
            f"({', '.join(f'{t} {v:.0f}' for t, v in means.items())}): their templates differ")


def build_model_report(runs: Iterable[RunResult], *, spec: dict[str, Any],
                       phases: Sequence[dict[str, Any]], servers: dict[str, dict[str, Any]],
                       skipped: dict[str, str], extra: dict[str, Any] | None = None,
                       baseline: str = LLAMACPP) -> dict[str, Any]:
    """One model's section of the report (see the module docstring).  ``runs``
    carry their phase name in ``mode`` and their round in ``round``."""
    grouped: dict[str, dict[str, dict[int, RunResult]]] = {}
    targets: list[str] = []
    for run in runs:
        if run.target not in targets:
            targets.append(run.target)
        grouped.setdefault(run.mode, {}).setdefault(run.target, {})[run.round] = run
    targets += [name for name in servers if name not in targets]
    phase_out = [_phase_details(ph, grouped.get(ph["name"], {})) for ph in phases]
    cols = columns_for(phases)
    headline: dict[str, dict[str, Any]] = {}
    for target in targets:
        h: dict[str, Any] = {}
        for col in cols:
            if col["phase"] is None:
                rss = servers.get(target, {}).get("peak_rss_bytes")
                h[col["key"]] = None if rss is None else rss / 2**20
            else:
                by_round = grouped.get(col["phase"], {}).get(target, {})
                h[col["key"]] = _value(col, [by_round[r] for r in sorted(by_round)])
        headline[target] = h
    if baseline in headline:
        for target, h in headline.items():
            h[f"vs_{baseline}"] = _versus(cols, h, headline[baseline], grouped, target, baseline)
    notes = [n for n in (_prompt_mismatch(ph) for ph in phase_out) if n]
    return {"model": spec, "baseline": baseline, "columns": cols, "targets": targets,
            "skipped": skipped, "phases": phase_out, "servers": servers, "headline": headline,
            "notes": notes, **(extra or {})}


def _versus(cols: list[dict[str, Any]], h: dict[str, Any], base: dict[str, Any],
            grouped: dict[str, dict[str, dict[int, RunResult]]], target: str,
            baseline: str) -> dict[str, Any]:
    vs: dict[str, Any] = {}
    for col in cols:
        key = col["key"]
        vs[key] = speed_ratio(col, h[key], base[key])
        if col["phase"] is None:
            continue
        mine = grouped.get(col["phase"], {}).get(target, {})
        theirs = grouped.get(col["phase"], {}).get(baseline, {})
        paired = [r for r in sorted(mine) if r in theirs]
        if len(paired) > 1:
            by_round = [speed_ratio(col, _value(col, [mine[r]]), _value(col, [theirs[r]]))
                        for r in paired]
            known = [x for x in by_round if x is not None]
            vs[key + "_pooled"] = vs[key]
            vs[key + "_by_round"] = by_round
            vs[key] = statistics.median(known) if known else None
    return vs


def _fmt(x: float | None, spec: str = ".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _cell(col: dict[str, Any], value: float | None, vs: float | None) -> str:
    if col["key"].startswith("ttft_") and value is not None:
        text = f"{value / 1000:.2f} s"
    else:
        text = _fmt(value, col["fmt"])
    return f"{text} {_fmt(vs, '.2f') + 'x' if vs is not None else ''}".rstrip()


def _blas_name(blas: Any) -> str:
    if not isinstance(blas, dict):
        return "-"
    name = str(blas.get("name", "?"))
    if blas.get("threads"):
        name += f" {blas['threads']}t"
    return name


def _model_title(m: dict[str, Any]) -> str:
    spec = m["model"]
    parts = [Path(str(spec.get("gguf") or spec.get("directory") or "")).name,
             spec.get("architecture"), f"context {spec.get('context')}" if spec.get("context") else None,
             f"{spec['weight_bytes'] / 1e9:.2f} GB read per token" if spec.get("weight_bytes") else None,
             f"via /v1/{spec.get('api', 'chat').replace('chat', 'chat/completions')}",
             f"prompts counted with {m['prompt_counter']}" if m.get("prompt_counter") else None]
    return f"== {spec['name']}: " + ", ".join(str(p) for p in parts if p)


def format_model(m: dict[str, Any]) -> list[str]:
    """One model's table (a row per target: figures with their ratio to
    llama.cpp), then each phase's details, skips and notes."""
    base = m.get("baseline", LLAMACPP)
    cols = m["columns"]
    widths = [max(15, len(c["title"])) for c in cols]
    head = f"{'target':<17}" + "".join(f" {c['title']:>{w}}" for c, w in zip(cols, widths, strict=True))
    head += "  ISA / BLAS / threads"
    lines = [_model_title(m), head, "-" * len(head)]
    for target in m["targets"]:
        h = m["headline"].get(target, {})
        vs = h.get(f"vs_{base}", {})
        row = f"{target:<17}" + "".join(f" {_cell(c, h.get(c['key']), vs.get(c['key'])):>{w}}"
                                        for c, w in zip(cols, widths, strict=True))
        srv = m.get("servers", {}).get(target, {})
        row += f"  {srv.get('isa') or '-'} / {_blas_name(srv.get('blas'))} / {srv.get('threads') or '-'}"
        lines.append(row)
    lines.append("")
    dh = (f"{'phase':<10} {'target':<17} {'ok':>7} {'tok/s':>8} {'decode':>7} {'TTFT p50':>9} "
          f"{'p90':>9} {'ITL p50':>8} {'prompt':>7} {'out':>5}  errors")
    lines += [dh, "-" * len(dh)]
    for ph in m["phases"]:
        for target in m["targets"]:
            s = ph["by_target"].get(target)
            if s is None:
                continue
            errs = ",".join(f"{k}={v}" for k, v in s["errors"].items()) or "0"
            lines.append(
                f"{ph['name']:<10} {target:<17} {s['ok']:>3}/{s['requests']:<3} "
                f"{_fmt(s['output_tokens_per_s']):>8} {_fmt(s.get('decode_tok_s_p50')):>7} "
                f"{_fmt(s['ttft_ms']['p50'], '.0f'):>9} {_fmt(s['ttft_ms']['p90'], '.0f'):>9} "
                f"{_fmt(s['itl_ms']['p50'], '.2f'):>8} {_fmt(s.get('prompt_tokens_mean'), '.0f'):>7} "
                f"{_fmt(s['output_tokens_per_request']['mean'], '.0f'):>5}  {errs}")
    for ph in m["phases"]:
        lines.append(f"{ph['name']}: {ph.get('title', '')}")
    lines += [f"skipped {name}: {why}" for name, why in m.get("skipped", {}).items()]
    lines += m.get("notes", [])
    if m.get("competing_load"):
        n = m["competing_load"]
        lines.append(f"under a competing load: {n} process{'es' if n > 1 else ''} spinning on the CPU "
                     "through every phase (--competing-load)")
    if m.get("loadavg_start"):
        lines.append(f"load average {m['loadavg_start'][0]:.2f} at start, "
                     f"{m.get('loadavg_end', [math.nan])[0]:.2f} at end; "
                     f"{m.get('elapsed_s', 0) / 60:.1f} min")
    return lines


def format_real_table(report: dict[str, Any]) -> str:
    """Every model's table, then what could not run and the legend."""
    lines: list[str] = []
    for m in report.get("models", []):
        lines += [*format_model(m), ""]
    for name, why in (report.get("missing") or {}).items():
        lines.append(f"model {name} not run: {why}")
    meta = report.get("meta", {})
    rounds = (report.get("config") or {}).get("rounds") or 1
    lines.append(f"machine: {meta.get('cpu_count')} cpus; load average "
                 f"{_fmt((meta.get('loadavg_start') or [None])[0], '.2f')} at start, "
                 f"{_fmt((meta.get('loadavg_end') or [None])[0], '.2f')} at end"
                 + (f"; environment {' '.join(f'{k}={v}' for k, v in meta['env'].items())}"
                    if meta.get("env") else ""))
    lines.append(f"Nx: against {report.get('baseline', LLAMACPP)} in the same run, above 1 = better "
                 "(tokens/s: this/llama.cpp; TTFT: llama.cpp/this); peak RSS: this/llama.cpp "
                 "(VmHWM; raw's is the benchmark process)"
                 + (f"; speed ratios are medians of {rounds} interleaved rounds' paired ratios."
                    if rounds > 1 else "."))
    lines.append("decode = median per-request (tokens-1)/(end - first token); TTFT = median time to "
                 "first token, prompt caches off, every prompt unique from its first line.")
    return "\n".join(lines)


def plot_real(report: dict[str, Any], path: Path) -> Path:
    """One panel per model: each target's ratio to llama.cpp per figure
    (bars; the line at 1 is llama.cpp)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report.get("models") or []
    fig, axes = plt.subplots(max(1, len(models)), 1, figsize=(11, 3.6 * max(1, len(models))),
                             squeeze=False)
    for ax, m in zip(axes[:, 0], models or [None], strict=True):
        if m is None:
            ax.set_title("no model ran")
            continue
        base = m.get("baseline", LLAMACPP)
        cols = m["columns"]
        others = [t for t in m["targets"] if t != base]
        width = 0.8 / max(1, len(others))
        for k, t in enumerate(others):
            vs = m["headline"].get(t, {}).get(f"vs_{base}", {})
            values = [vs.get(c["key"]) or 0.0 for c in cols]
            xs = [i + k * width for i in range(len(cols))]
            ax.bar(xs, values, width, label=t)
            for x, v in zip(xs, values, strict=True):
                if v:
                    ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cols))],
                      [c["title"] + (" (lower)" if c["key"] == "peak_rss_mib" else "") for c in cols],
                      fontsize=8)
        ax.set_title(f"{m['model']['name']}: x {base} (above 1: better; RSS: this/llama.cpp)",
                     fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_real_report(report: dict[str, Any], out_dir: Path) -> Sequence[Path]:
    """Write ``report.json``, ``report.txt`` and ``report.png`` to ``out_dir``."""
    return write_report(report, out_dir, table=format_real_table, draw=plot_real)
