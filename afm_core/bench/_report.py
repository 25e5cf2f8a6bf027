"""Turn run results into the report: JSON, a readable table and a PNG plot.

Every served figure is set against ``raw`` from the same run (``*_vs_raw``)
and, when both ran, ours against the peer (``ours_vs_peer``) and against raw
with the engine's CPU kernels (``ours_vs_raw_kernels``: the server's own cost
apart from the kernels).  Latencies are milliseconds.

A run over several wire APIs names its targets by API slot (``ours[chat]``,
``raw[chat]``, ``ours[chat#2]``; see ``_apis``): each is set against the raw
target of its own slot, ours against the peer slot by slot
(``ours_vs_peer_by_api``), and ``api_comparison`` answers "is every API's
served ÷ raw ratio within a few % of chat's": per level and API, the ratio's
median over the rounds and its range, and each round's ratio over the
reference API's (chat's) in the same round, as a difference in %.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ._apis import prompt_form, slot_api, slot_target, split_target
from ._results import RunResult
from ._stats import ratio

RAW = "raw"
RAW_KERNELS = "raw+kernels"
OURS = "ours"
PEER = "mlx_lm.server"


def _p(summary: dict[str, Any], metric: str, q: str = "p50") -> float | None:
    value = summary.get(metric, {}).get(q)
    return None if value is None else float(value)


def raw_of(kind: str, slot: str, forms: dict[str, str] | None = None) -> str:
    """The raw target (``kind`` raw or raw+kernels) that runs ``slot``'s
    prompts in a run over several APIs: one per prompt form, as the run's
    config says (``raw_forms``, by slot), else ``_apis.prompt_form``
    (``ours[messages]`` -> ``raw[chat]``)."""
    return slot_target(kind, (forms or {}).get(slot) or prompt_form(slot_api(slot)))


def baseline(target: str, forms: dict[str, str] | None = None) -> str:
    """The raw target a target's figures are set against: ``raw``, or in a
    run over several APIs the raw target of its slot's prompt form (``raw_of``)."""
    _, slot = split_target(target)
    return RAW if slot is None else raw_of(RAW, slot, forms)


def is_raw(target: str) -> bool:
    return split_target(target)[0] == RAW


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def compare(s: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """``s`` relative to ``base`` (ratios; TTFT also as a difference in ms)."""
    return {
        "output_tokens_per_s": ratio(s.get("output_tokens_per_s"), base.get("output_tokens_per_s")),
        "request_throughput": ratio(s.get("request_throughput"), base.get("request_throughput")),
        "ttft_p50": ratio(_p(s, "ttft_ms"), _p(base, "ttft_ms")),
        "ttft_p50_delta_ms": _delta(_p(s, "ttft_ms"), _p(base, "ttft_ms")),
        "itl_p50": ratio(_p(s, "itl_ms"), _p(base, "itl_ms")),
        "itl_p99": ratio(_p(s, "itl_ms", "p99"), _p(base, "itl_ms", "p99")),
        "e2e_p50": ratio(_p(s, "e2e_ms"), _p(base, "e2e_ms")),
    }


def _rounds_compare(s: dict[str, Any], base: dict[str, Any], s_rounds: dict[int, float | None],
                    base_rounds: dict[int, float | None]) -> dict[str, Any]:
    """``compare`` of the pooled summaries; with several rounds (tokens/s by
    round number), the tokens/s ratio is the median of the rounds' paired
    ratios (a burst of load from elsewhere that hits one round moves it
    little), and the pooled ratio and every round's are kept beside it."""
    out: dict[str, Any] = compare(s, base)
    if len(s_rounds) > 1:
        by_round = [ratio(s_rounds[r], base_rounds[r]) for r in sorted(s_rounds) if r in base_rounds]
        known = [x for x in by_round if x is not None]
        out["output_tokens_per_s_pooled"] = out["output_tokens_per_s"]
        out["output_tokens_per_s_by_round"] = by_round
        out["output_tokens_per_s"] = statistics.median(known) if known else None
    return out


def build_report(runs: Iterable[RunResult], *, meta: dict[str, Any],
                 config: dict[str, Any], skipped: dict[str, str]) -> dict[str, Any]:
    """The whole report as a JSON-able dict, grouped by load level (a
    level's rounds pooled; see ``_rounds_compare`` for the ratios)."""
    levels: dict[tuple[str, float], dict[str, Any]] = {}
    grouped: dict[tuple[str, float], dict[str, dict[int, RunResult]]] = {}
    targets: list[str] = []
    for run in runs:
        if run.target not in targets:
            targets.append(run.target)
        key = (run.mode, run.level)
        levels.setdefault(key, {"mode": run.mode, "level": run.level, "label": run.label,
                                "by_target": {}})
        grouped.setdefault(key, {}).setdefault(run.target, {})[run.round] = run
    forms: dict[str, str] = config.get("raw_forms") or {}
    for key, entry in levels.items():
        by = entry["by_target"]
        tps: dict[str, dict[int, float | None]] = {}  # tokens/s by target, by round
        for target, runs_by_round in grouped[key].items():
            order = sorted(runs_by_round)
            by[target] = RunResult.pooled([runs_by_round[r] for r in order]).summary()
            tps[target] = {r: runs_by_round[r].summary()["output_tokens_per_s"] for r in order}
            if len(order) > 1:
                by[target]["rounds"] = len(order)
                by[target]["output_tokens_per_s_by_round"] = list(tps[target].values())
        if any(is_raw(t) for t in by):
            entry["vs_raw"] = {t: _rounds_compare(by[t], by[b], tps[t], tps[b]) for t in by
                               if not is_raw(t) and (b := baseline(t, forms)) in by}
        slots = config.get("slots") or ()
        for pair, other in (("ours_vs_peer", PEER), ("ours_vs_raw_kernels", RAW_KERNELS)):
            if not slots:
                if OURS in by and other in by:
                    entry[pair] = _rounds_compare(by[OURS], by[other], tps[OURS], tps[other])
                continue
            pairs = {s: (slot_target(OURS, s), raw_of(other, s, forms) if other == RAW_KERNELS
                         else slot_target(other, s)) for s in slots}
            found = {s: _rounds_compare(by[a], by[b], tps[a], tps[b])
                     for s, (a, b) in pairs.items() if a in by and b in by}
            if found:
                entry[pair + "_by_api"] = found
        if slots:
            entry["api_comparison"] = api_comparison(by, tps, slots, forms)
    ordered = sorted(levels.values(), key=lambda e: (e["mode"] != "closed", e["level"]))
    return {"meta": meta, "config": config, "targets": targets, "skipped": skipped,
            "levels": ordered}


SERVED_KINDS = (OURS, PEER, "url", RAW_KERNELS)
"""The targets ``api_comparison`` sets against raw, slot by slot, in this order."""


def reference_slot(slots: Sequence[str]) -> str:
    """The slot every other is compared with: the first chat, else the first."""
    return next((s for s in slots if slot_api(s) == "chat"), slots[0])


def _spread(values: list[float | None]) -> dict[str, Any]:
    known = sorted(v for v in values if v is not None)
    quartiles = statistics.quantiles(known, n=4) if len(known) > 1 else known * 3
    return {"median": statistics.median(known) if known else None,
            "q1": quartiles[0] if known else None, "q3": quartiles[2] if known else None,
            "min": min(known) if known else None, "max": max(known) if known else None,
            "by_round": values}


def _pct_over(x: float | None, ref: float | None) -> float | None:
    r = ratio(x, ref)
    return None if r is None else (r - 1.0) * 100.0


def api_comparison(by: dict[str, dict[str, Any]], tps: dict[str, dict[int, float | None]],
                   slots: Sequence[str], forms: dict[str, str] | None = None) -> dict[str, Any]:
    """For each served kind and API slot at one level:

    * ``ratio``: the tokens/s ratio to the slot's raw target (``raw``; in a
      run without it, ``raw+kernels``) round by round
      (median, quartiles, min, max, by_round);
    * ``vs_reference_pct``: each round's ratio over the reference slot's
      ratio in the same round, minus 1, in % (the A/A slot ``chat#2`` shows
      how far two identical APIs drift apart);
    * ``pooled_ratio`` and ``pooled_vs_reference_pct``: the same over all
      rounds' tokens and wall time together;
    * ``server_cpu_ms_per_token`` / ``client_cpu_ms_per_token`` and their
      ``..._vs_reference_pct``: the CPU time the server and the load
      generator spent per output token, all rounds together (a cost that
      the machine's load moves far less than wall time)."""
    ref = reference_slot(slots)
    out: dict[str, Any] = {"reference": ref}
    for kind in SERVED_KINDS:
        per_round: dict[str, dict[int, float | None]] = {}
        rows: dict[str, Any] = {}
        for slot in slots:
            target = slot_target(kind, slot)
            raw = raw_of(RAW, slot, forms)
            if raw not in by:  # a run without plain raw: raw with the engine's kernels
                raw = raw_of(RAW_KERNELS, slot, forms)
            if target not in by or raw not in by or target == raw:
                continue
            per_round[slot] = {r: ratio(tps[target][r], tps[raw].get(r)) for r in tps[target]}
            s = by[target]
            rows[slot] = {"api": slot_api(slot), "target": target, "raw": raw,
                          "ratio": _spread(list(per_round[slot].values())),
                          "pooled_ratio": ratio(s.get("output_tokens_per_s"),
                                                by[raw].get("output_tokens_per_s")),
                          "server_cpu_ms_per_token": s.get("server_cpu_ms_per_token"),
                          "client_cpu_ms_per_token": s.get("client_cpu_ms_per_token"),
                          "ttft_p50_ms": _p(s, "ttft_ms"),
                          "raw_ttft_p50_ms": _p(by[raw], "ttft_ms")}
        if not rows:
            continue
        if ref in per_round:
            base, ref_row = per_round[ref], rows[ref]
            for slot, row in rows.items():
                if slot == ref:
                    continue
                diffs = [_pct_over(x, base.get(r)) for r, x in per_round[slot].items()]
                row["vs_reference_pct"] = _spread(diffs)
                for key in ("pooled_ratio", "server_cpu_ms_per_token", "client_cpu_ms_per_token"):
                    row[key.removesuffix("_ratio") + "_vs_reference_pct"] = _pct_over(
                        row[key], ref_row[key])
        out[kind] = rows
    return out


def _fmt(x: float | None, spec: str = ".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def format_table(report: dict[str, Any]) -> str:
    """A fixed-width table: one row per target per level, then ours/peer
    (and, over several APIs, the comparison of their ratios to raw)."""
    tw = max([14, *(len(t) + 1 for t in report["targets"])])
    head = (f"{'level':<11} {'target':<{tw}} {'tok/s':>9} {'x raw':>6} {'req/s':>7} "
            f"{'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} {'p99':>7} "
            f"{'E2E p50':>8} {'ok':>5}  errors")
    config = report.get("config") or {}
    api, slots = config.get("api", "chat"), config.get("slots") or ()
    lines = [f"served targets driven through the {api} API"] if api != "chat" and not slots else []
    if slots:
        lines.append(f"wire APIs {', '.join(slots)} in one run: one server each, one target "
                     "per API on it (ours[API]); raw[API] runs that target's prompts in-process")
    lines += [head, "-" * len(head)]
    for entry in report["levels"]:
        by = entry["by_target"]
        vs = entry.get("vs_raw", {})
        for target in report["targets"]:
            s = by.get(target)
            if s is None:
                continue
            x_raw = vs.get(target, {}).get("output_tokens_per_s") if not is_raw(target) else 1.0
            errs = ",".join(f"{k}={v}" for k, v in s["errors"].items()) or "0"
            if s.get("truncated"):
                errs += " (time budget hit)"
            lines.append(
                f"{entry['label']:<11} {target:<{tw}} {_fmt(s['output_tokens_per_s']):>9} "
                f"{_fmt(x_raw, '.3f'):>6} {_fmt(s['request_throughput'], '.2f'):>7} "
                f"{_fmt(_p(s, 'ttft_ms')):>9} {_fmt(_p(s, 'ttft_ms', 'p90')):>7} "
                f"{_fmt(_p(s, 'ttft_ms', 'p99')):>7} {_fmt(_p(s, 'itl_ms'), '.2f'):>8} "
                f"{_fmt(_p(s, 'itl_ms', 'p99'), '.2f'):>7} {_fmt(_p(s, 'e2e_ms')):>8} "
                f"{s['ok']:>5}  {errs}")
        for target, s in by.items():
            prof = s.get("profile")
            if prof:
                keys = ("decode_tok_s", "prefill_tok_s", "ttft_s", "batch_size_mean",
                        "cached_tokens", "memory_peak_gib")
                means = prof["summary_mean"]
                shown = " ".join(f"{k}={means[k]:.4g}" for k in keys if k in means)
                lines.append(f"{entry['label']:<11} {target + ' prof':<{tw}} "
                             f"({prof['captured']} profiles, means) {shown}")
        pairs = [(label, entry.get(key)) for key, label in (("ours_vs_peer", "ours/peer"),
                                                            ("ours_vs_raw_kernels", "ours/raw+k"))]
        for key, label in (("ours_vs_peer_by_api", "ours/peer"),
                           ("ours_vs_raw_kernels_by_api", "ours/raw+k")):
            pairs += [(f"{label}[{slot}]", ovp) for slot, ovp in (entry.get(key) or {}).items()]
        for label, ovp in pairs:
            if ovp:
                lines.append(
                    f"{entry['label']:<11} {label:<{tw}} {_fmt(ovp['output_tokens_per_s'], '.3f'):>9}"
                    f" {'':>6} {_fmt(ovp['request_throughput'], '.3f'):>7} "
                    f"{_fmt(ovp['ttft_p50'], '.3f'):>9} {'':>7} {'':>7} "
                    f"{_fmt(ovp['itl_p50'], '.3f'):>8} {_fmt(ovp['itl_p99'], '.3f'):>7} "
                    f"{_fmt(ovp['e2e_p50'], '.3f'):>8}")
        lines.append("")
    if slots:
        lines.extend(format_api_comparison(report))
    lines.extend(run_footer(report))
    shares = [s["client_cpu_share"] for e in report["levels"] for s in e["by_target"].values()
              if s.get("client_cpu_share") is not None]
    if shares:
        lines.append(f"load generator CPU: {min(shares):.2f}-{max(shares):.2f} cores "
                     "(same machine as the servers; raw has no client)")
    lines.append("tok/s from usage.completion_tokens over wall time; latencies in ms; "
                 "x raw = tok/s ratio to in-process BatchGenerator in this run.")
    rounds = (report.get("config") or {}).get("rounds") or 1
    if rounds > 1:
        lines.append(f"{rounds} rounds per level, each on fresh prompts, pooled; ratios (x raw, "
                     "ours/peer, ours/raw+k tok/s) are medians of the rounds' paired ratios.")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def format_api_comparison(report: dict[str, Any]) -> list[str]:
    """Per served kind, level and API: tok/s ÷ raw (median over the rounds
    and its range), the paired difference from the reference API's ratio
    (median and interquartile range), the pooled difference, and the
    server's and client's CPU time per token (and their difference)."""
    lines: list[str] = []
    rounds = (report.get("config") or {}).get("rounds") or 1
    entries = [e for e in report["levels"] if e.get("api_comparison")]
    for kind in SERVED_KINDS:
        if not any(kind in e["api_comparison"] for e in entries):
            continue
        ref = entries[0]["api_comparison"]["reference"]
        rows: dict[str, Any] = next(e["api_comparison"][kind] for e in entries
                                    if kind in e["api_comparison"])
        raw_name = split_target(next(iter(rows.values()))["raw"])[0]
        lines.append(f"{kind} ÷ {raw_name}, tokens/s, by wire API: median of {rounds} round(s) "
                     "[min-max]; "
                     f"vs {ref}: each round's ratio over {ref}'s in that round, -1 "
                     "(median [quartiles]); pooled: all rounds' tokens over their wall time; "
                     "CPU: ms per output token, all rounds (vs ref)")
        cw = max(12, len(kind) + len(raw_name) + 3)
        head = (f"{'level':<11} {'API':<14} {kind + ' ÷ ' + raw_name:>{cw}} {'range':>15} "
                f"{'vs ' + ref:>10} {'quartiles':>18} {'pooled':>8} {'server CPU':>17} "
                f"{'client CPU':>17} {'TTFT p50':>9} {'raw':>7}")
        lines += [head, "-" * len(head)]
        for entry in entries:
            for slot, row in (entry["api_comparison"].get(kind) or {}).items():
                r, d = row["ratio"], row.get("vs_reference_pct")
                span = f"[{_fmt(r['min'], '.3f')}-{_fmt(r['max'], '.3f')}]"
                dspan = f"[{_pct(d['q1'])}, {_pct(d['q3'])}]" if d else ""

                def cpu(key: str, row: dict[str, Any] = row) -> str:
                    vs = row.get(key + "_vs_reference_pct")
                    return (_fmt(row.get(key), ".3f")
                            + (f" ({_pct(vs)})" if vs is not None else ""))

                lines.append(
                    f"{entry['label']:<11} {slot:<14} {_fmt(r['median'], '.3f'):>{cw}} {span:>15} "
                    f"{_pct(d['median']) if d else '-':>10} {dspan:>18} "
                    f"{_pct(row.get('pooled_vs_reference_pct')):>8} "
                    f"{cpu('server_cpu_ms_per_token'):>17} {cpu('client_cpu_ms_per_token'):>17} "
                    f"{_fmt(row['ttft_p50_ms']):>9} {_fmt(row['raw_ttft_p50_ms']):>7}")
        lines.append("")
    return lines


def plot(report: dict[str, Any], path: Path) -> Path:
    """Throughput, ratio to raw, TTFT and ITL vs concurrency (closed loop; vs
    the offered rate when the run has no closed-loop level)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [e for e in report["levels"] if e["mode"] == "closed"]
    xlabel = "concurrent streams"
    if not shown:  # an open-loop-only run: the same figures against the offered rate
        shown = [e for e in report["levels"] if e["mode"] == "open"]
        xlabel = "offered rate (requests/s)"
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (ax_tps, ax_ratio), (ax_ttft, ax_itl) = axes
    for target in report["targets"]:
        pts = [(e["level"], e["by_target"][target]) for e in shown if target in e["by_target"]]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ss = [p[1] for p in pts]
        (line,) = ax_tps.plot(xs, [_nan(s["output_tokens_per_s"]) for s in ss], "o-", label=target)
        color = line.get_color()
        ax_ttft.plot(xs, [_nan(_p(s, "ttft_ms")) for s in ss], "o-", color=color,
                     label=f"{target} p50")
        ax_ttft.plot(xs, [_nan(_p(s, "ttft_ms", "p99")) for s in ss], "x--", color=color,
                     alpha=0.6, label=f"{target} p99")
        ax_itl.plot(xs, [_nan(_p(s, "itl_ms")) for s in ss], "o-", color=color,
                    label=f"{target} p50")
        ax_itl.plot(xs, [_nan(_p(s, "itl_ms", "p99")) for s in ss], "x--", color=color,
                    alpha=0.6, label=f"{target} p99")
        if not is_raw(target):
            rs = [e.get("vs_raw", {}).get(target, {}).get("output_tokens_per_s")
                  for e in shown if target in e["by_target"]]
            if any(r is not None for r in rs):
                ax_ratio.plot(xs, [_nan(r) for r in rs], "o-", color=color, label=target)
    if ax_ratio.lines:
        ax_ratio.axhline(1.0, color="grey", lw=0.8)
        ax_ratio.axhline(0.95, color="grey", lw=0.8, ls=":")
    else:
        ax_ratio.text(0.5, 0.5, "no raw target in this run", ha="center", va="center",
                      transform=ax_ratio.transAxes, color="grey")
    titles = [(ax_tps, "output tokens/s"), (ax_ratio, "tokens/s ÷ raw"),
              (ax_ttft, "TTFT (ms)"), (ax_itl, "inter-token latency (ms)")]
    ticks = sorted({e["level"] for e in shown})
    for ax, title in titles:
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        if ticks:
            # explicit limits: a log axis with no data (or one level) has none of its own
            ax.set_xlim(ticks[0] / 1.5, ticks[-1] * 1.5)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in (ax_ttft, ax_itl):
        if _has_positive(ax):  # a level where every request failed has no latencies
            ax.set_yscale("log")
    model = report.get("meta", {}).get("model", "")
    fig.suptitle(f"afm bench: {Path(str(model)).name or model}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _has_positive(ax: Any) -> bool:
    return any(math.isfinite(y) and y > 0 for line in ax.lines for y in line.get_ydata())


def _nan(x: float | None) -> float:
    return math.nan if x is None else float(x)


def run_footer(report: dict[str, Any]) -> list[str]:
    """The skipped targets and the machine's load, for the foot of a table."""
    lines = [f"skipped {name}: {why}" for name, why in (report.get("skipped") or {}).items()]
    meta = report.get("meta", {})
    if "loadavg_start" in meta:
        lines.append(f"machine: {meta.get('cpu_count')} cpus, load average "
                     f"{meta['loadavg_start'][0]:.2f} at start, "
                     f"{meta.get('loadavg_end', [math.nan])[0]:.2f} at end")
    return lines


def write_report(report: dict[str, Any], out_dir: Path, *,
                 table: Callable[[dict[str, Any]], str] | None = None,
                 draw: Callable[[dict[str, Any], Path], Path] | None = None) -> Sequence[Path]:
    """Write ``report.json``, ``report.txt`` (``table``, default
    :func:`format_table`) and ``report.png`` (``draw``, default :func:`plot`)
    to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=2, allow_nan=False, default=str) + "\n")
    txt_path = out_dir / "report.txt"
    txt_path.write_text((table or format_table)(report) + "\n")
    png_path = (draw or plot)(report, out_dir / "report.png")
    return json_path, txt_path, png_path
