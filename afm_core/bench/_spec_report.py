"""The report of ``afm bench --speculation`` (see ``_spec`` for the method).

Per workload (``chat``, ``code_edit``) and target: decode tok/s (median per
request), ``x ours`` and ``x llama.cpp`` (medians of the rounds' paired
ratios to the plain afm and the plain llama.cpp target), acceptance,
tokens proposed per verify step, bytes of weights read per emitted token
(and the draft's break-even acceptance), and whether the greedy text equals
the plain twin's (``PLAIN_OF``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._llamacpp import LLAMACPP
from ._real_report import decode_rates
from ._report import write_report
from ._results import RunResult
from ._stats import ratio

__all__ = ["build_spec_report", "bytes_per_token", "format_spec_table", "write_spec_report"]

PLAIN_OF = {"ours+lookup": "ours", "ours+draft": "ours", "llama.cpp+draft": LLAMACPP}
OURS = "ours"


def bytes_per_token(*, decoded: int, proposed: int, accepted: int, model_bytes: int,
                    draft_bytes: int = 0) -> float | None:
    """Weight bytes read per emitted token (see ``_spec``'s module docstring)."""
    if decoded <= 0:
        return None
    steps = max(decoded - accepted, 0)
    return (proposed * draft_bytes + steps * model_bytes) / decoded


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _paired(mine: dict[int, RunResult], base: dict[int, RunResult]) -> tuple[float | None, list[float | None]]:
    by_round = [ratio(_median(decode_rates(mine[r])), _median(decode_rates(base[r])))
                for r in sorted(mine) if r in base]
    known = [x for x in by_round if x is not None]
    return (statistics.median(known) if known else None), by_round


def _texts(runs: dict[int, RunResult]) -> dict[tuple[int, int], str | None]:
    return {(r, q.index): q.text for r, run in runs.items() for q in run.requests if q.ok}


def same_text(mine: dict[int, RunResult], plain: dict[int, RunResult]) -> dict[str, Any]:
    """How many of ``mine``'s answers equal the plain target's for the same job."""
    a, b = _texts(mine), _texts(plain)
    both = [k for k in a if k in b]
    differ = [k for k in both if a[k] != b[k]]
    return {"compared": len(both), "differ": len(differ), "same": bool(both) and not differ}


def _row(target: str, wl: str, rounds: dict[int, RunResult],
         grouped: dict[str, dict[str, dict[int, RunResult]]],
         counters: dict[tuple[str, str, int], dict[str, float]],
         model_bytes: int | None, draft_bytes: int | None) -> dict[str, Any]:
    order = sorted(rounds)
    rates = [x for r in order for x in decode_rates(rounds[r])]
    ok = [q for r in order for q in rounds[r].requests if q.ok]
    decoded = sum(max(q.output_tokens - 1, 0) for q in ok)
    got = [counters.get((target, wl, r), {}) for r in order]
    proposed = sum(g.get("proposed", 0.0) for g in got)
    accepted = sum(g.get("accepted", 0.0) for g in got)
    steps = sum(g.get("steps", 0.0) for g in got)
    drafted = target.endswith("+draft")
    row: dict[str, Any] = {
        "decode_tok_s": _median(rates), "requests": len(ok), "decoded_tokens": decoded,
        "proposed": proposed, "accepted": accepted, "verify_steps": steps or None,
        "acceptance": ratio(accepted, proposed) if proposed else None,
        "proposed_per_step": ratio(proposed, steps) if steps else None,
    }
    for key, base in (("vs_ours", OURS), (f"vs_{LLAMACPP}", LLAMACPP)):
        theirs = grouped[wl].get(base)
        if theirs:
            row[key], row[key + "_by_round"] = _paired(rounds, theirs)
    if model_bytes:

        bd = (draft_bytes or 0) if drafted else 0
        row["bytes_per_token"] = bytes_per_token(decoded=decoded, proposed=int(proposed),
                                                 accepted=int(accepted), model_bytes=model_bytes,
                                                 draft_bytes=bd)
        row["bytes_per_token_vs_plain"] = ratio(row["bytes_per_token"], float(model_bytes))
        if drafted and draft_bytes:
            row["break_even_acceptance"] = draft_bytes / model_bytes
    plain = PLAIN_OF.get(target)
    if plain and plain in grouped[wl]:
        row["same_text_as"] = plain
        row["same_text"] = same_text(rounds, grouped[wl][plain])
    return row


def build_spec_report(runs: Sequence[RunResult], counters: dict[tuple[str, str, int], dict[str, float]],
                      *, model: dict[str, Any], draft: dict[str, Any], servers: dict[str, Any],
                      skipped: dict[str, str], meta: dict[str, Any], config: dict[str, Any],
                      workloads: dict[str, Any]) -> dict[str, Any]:
    """The report as a JSON-able dict (``runs`` carry the workload in ``mode``)."""
    grouped: dict[str, dict[str, dict[int, RunResult]]] = {}
    targets: list[str] = []
    for run in runs:
        if run.target not in targets:
            targets.append(run.target)
        grouped.setdefault(run.mode, {}).setdefault(run.target, {})[run.round] = run
    table = {wl: {t: _row(t, wl, by_target[t], grouped, counters, model.get("weight_bytes"),
                          draft.get("weight_bytes")) for t in targets if t in by_target}
             for wl, by_target in grouped.items()}
    agree = {}
    for wl, by_target in grouped.items():
        if OURS in by_target and LLAMACPP in by_target:
            agree[wl] = same_text(by_target[OURS], by_target[LLAMACPP])
    return {"mode": "speculation", "model": model, "draft": draft, "targets": targets,
            "workloads": workloads, "table": table, "ours_vs_llamacpp_text": agree,
            "servers": servers, "skipped": skipped, "meta": meta, "config": config}


def _fmt(x: float | None, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _same(row: dict[str, Any]) -> str:
    s = row.get("same_text")
    if s is None:
        return "-"
    return "yes" if s["same"] else f"NO {s['differ']}/{s['compared']}"


def format_spec_table(report: dict[str, Any]) -> str:
    model, draft = report["model"], report["draft"]

    def gb(b: int | None) -> str:
        return f"{b / 1e9:.3f} GB" if b else "?"

    lines = [f"model {model['name']} ({gb(model.get('weight_bytes'))} read per forward), "
             f"draft {draft['name']} ({gb(draft.get('weight_bytes'))})", ""]
    head = (f"{'workload':<10} {'target':<16} {'tok/s':>7} {'x ours':>7} {'x llama':>8} {'accept':>7} "
            f"{'prop/step':>9} {'MB/token':>9} {'x plain':>8} {'break-even':>10} {'same text':>10}")
    lines += [head, "-" * len(head)]
    for wl, rows in report["table"].items():
        for t, row in rows.items():
            bpt = row.get("bytes_per_token")
            lines.append(
                f"{wl:<10} {t:<16} {_fmt(row['decode_tok_s'], '.1f'):>7} "
                f"{_fmt(row.get('vs_ours'), '.2f'):>7} {_fmt(row.get(f'vs_{LLAMACPP}'), '.2f'):>8} "
                f"{_fmt(row['acceptance'], '.0%'):>7} {_fmt(row['proposed_per_step'], '.2f'):>9} "
                f"{_fmt(None if bpt is None else bpt / 1e6, '.1f'):>9} "
                f"{_fmt(row.get('bytes_per_token_vs_plain'), '.2f'):>8} "
                f"{_fmt(row.get('break_even_acceptance'), '.0%'):>10} {_same(row):>10}")
    lines.append("")
    for wl, s in report.get("ours_vs_llamacpp_text", {}).items():
        lines.append(f"{wl}: ours and llama.cpp gave the same greedy text on "
                     f"{s['compared'] - s['differ']} of {s['compared']} requests")
    for t, srv in report.get("servers", {}).items():
        rss = srv.get("peak_rss_bytes")
        lines.append(f"{t}: ISA {srv.get('isa') or '-'}, threads {srv.get('threads') or '-'}, "
                     f"peak RSS {_fmt(None if rss is None else rss / 2**20, '.0f')} MiB")
    lines += [f"skipped {name}: {why}" for name, why in report.get("skipped", {}).items()]
    rounds = report.get("config", {}).get("rounds", 1)
    lines.append(f"tok/s: median per-request decode (prefill left out); x ours / x llama: medians of "
                 f"{rounds} interleaved rounds' paired ratios; accept: accepted/proposed; MB/token: "
                 "weights read per emitted token = (proposed x draft + (decoded - accepted) x model) "
                 "/ decoded; x plain: over the plain model's bytes; break-even: the acceptance at "
                 "which the draft's reads pay; same text: the greedy answers equal the plain twin's.")
    return "\n".join(lines)


def plot_spec(report: dict[str, Any], path: Path) -> Path:
    """Decode tok/s per target, one group of bars per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    wls = list(report["table"])
    targets = report["targets"]
    width = 0.8 / max(1, len(targets))
    for k, t in enumerate(targets):
        values = [report["table"][wl].get(t, {}).get("decode_tok_s") or 0.0 for wl in wls]
        ax.bar([i + k * width for i in range(len(wls))], values, width, label=t)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(wls))], wls)
    ax.set_ylabel("decode tok/s (1 stream)")
    ax.set_title(f"speculation on {report['model']['name']} (draft {report['draft']['name']})")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_spec_report(report: dict[str, Any], out_dir: Path) -> Sequence[Path]:
    return write_report(report, out_dir, table=format_spec_table, draw=plot_spec)
