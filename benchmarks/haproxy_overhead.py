"""The balancer's cost: one afm replica, straight vs through HAProxy, same load.

    .venv/bin/python benchmarks/haproxy_overhead.py [--model random|default|DIR]
        [--concurrency 8] [--requests 64] [--rounds 6] [--max-tokens 64]

Starts one ``afm serve`` replica and an ``haproxy`` with the configuration
``afm deploy haproxy`` renders for it (tests/deploy/cluster.py), then runs
``afm bench``'s closed-loop load generator (``--concurrency`` streams,
``--requests`` per run, streamed chat with usage) against the replica's own
port and against the balancer, alternating which goes first each round, each
run on fresh prompts (the replica's prefix cache is off, so neither run
benefits from the other's).  Prints both targets per round and the summary:
aggregate output tokens/s (median of the rounds, and the median of the
rounds' paired ratios balancer/direct) and TTFT p50/p99 over every request
of every round, with the balancer's difference in milliseconds.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import afm_core  # noqa: F401  (first: binds MLX's BLAS)

# isort: split
import argparse
import math
import os
import statistics

import trio
from _common import model_path

from afm_core.bench._loadgen import Target, run_closed
from afm_core.bench._results import RunResult
from afm_core.bench._workload import make_workload
from tests.deploy.cluster import Cluster, haproxy_binary


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench(targets: dict[str, str], args: argparse.Namespace,
                pids: dict[str, int]) -> tuple[dict[str, list[RunResult]], dict[str, list[dict]]]:
    runs: dict[str, list[RunResult]] = {name: [] for name in targets}
    cpu: dict[str, list[dict]] = {name: [] for name in targets}
    per_run = args.requests
    warm = make_workload(999, 16, prompt_words=(16, 64), max_tokens=args.max_tokens)
    for name, url in targets.items():  # warm both paths (connections, kernels)
        await run_closed(Target(name, url), warm, args.concurrency, 16, level_timeout=300,
                         request_timeout=120)
    for rnd in range(args.rounds):
        order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
        for k, name in enumerate(order):
            seed = 1000 * (rnd + 1) + k  # fresh prompts for every run
            workload = make_workload(seed, per_run, prompt_words=(16, 64), max_tokens=args.max_tokens)
            before = {p: cpu_seconds(pid) for p, pid in pids.items()}
            run = await run_closed(Target(name, targets[name]), workload, args.concurrency, per_run,
                                   level_timeout=600, request_timeout=120)
            used = {p: (cpu_seconds(pid) - before[p]) / run.duration for p, pid in pids.items()}
            used["client"] = (run.client_cpu_s or 0.0) / run.duration
            runs[name].append(run)
            cpu[name].append(used)
            s = run.summary()
            print(f"round {rnd + 1} {name:>8}: {s['output_tokens_per_s']:8.1f} tok/s  "
                  f"TTFT p50 {s['ttft_ms']['p50']:6.1f} ms p99 {s['ttft_ms']['p99']:6.1f} ms  "
                  f"errors {s['error_count']}  cores: "
                  + " ".join(f"{p} {c:.2f}" for p, c in used.items()), flush=True)
    return runs, cpu


def report(runs: dict[str, list[RunResult]], cpu: dict[str, list[dict]],
           args: argparse.Namespace) -> str:
    direct = runs["direct"]
    pooled = {name: RunResult.pooled(r).summary() for name, r in runs.items()}
    rates = {name: [r.summary()["output_tokens_per_s"] for r in rs] for name, rs in runs.items()}
    ratios = sorted(b / a for a, b in zip(rates["direct"], rates["haproxy"], strict=True))
    errors = {name: p["error_count"] for name, p in pooled.items()}
    d, h = pooled["direct"]["ttft_ms"], pooled["haproxy"]["ttft_ms"]
    lines = [
        f"c={args.concurrency}, {len(direct)} rounds x {args.requests} requests per target, "
        f"max_tokens {args.max_tokens}, model {args.model}",
        "| | direct | through HAProxy | HAProxy vs direct |",
        "| --- | --- | --- | --- |",
        f"| output tok/s (median of rounds) | {statistics.median(rates['direct']):.1f} | "
        f"{statistics.median(rates['haproxy']):.1f} | x{statistics.median(ratios):.3f} "
        f"(paired ratios {', '.join(f'{x:.3f}' for x in ratios)}) |",
        f"| TTFT p50 | {d['p50']:.1f} ms | {h['p50']:.1f} ms | {h['p50'] - d['p50']:+.1f} ms |",
        f"| TTFT p99 | {d['p99']:.1f} ms | {h['p99']:.1f} ms | {h['p99'] - d['p99']:+.1f} ms |",
        f"| errors | {errors['direct']} | {errors['haproxy']} | |",
    ]
    for proc in ("afm", "haproxy", "client"):
        d_c = statistics.median(c[proc] for c in cpu["direct"])
        h_c = statistics.median(c[proc] for c in cpu["haproxy"])
        lines.append(f"| {proc} CPU (cores, median) | {d_c:.2f} | {h_c:.2f} | {h_c - d_c:+.2f} |")
    assert not any(math.isnan(x) for x in ratios)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random", help="random (tiny test model), default, or DIR")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64, help="requests per run")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    if haproxy_binary() is None:
        raise SystemExit("haproxy is not installed (apt-get install haproxy / brew install haproxy)")
    work = Path(tempfile.mkdtemp(prefix="afm-haproxy-bench-"))
    model = model_path(args.model, work)
    replica_args = ("--prefix-cache-bytes", "0", "--max-batch", str(max(32, args.concurrency)))
    with Cluster(model, work / "cluster", 1, replica_args=replica_args) as cluster:
        targets = {"direct": cluster.replicas[0].url, "haproxy": cluster.balancer.url}
        assert cluster.balancer.proc is not None and cluster.replicas[0].proc is not None
        pids = {"afm": cluster.replicas[0].proc.pid, "haproxy": cluster.balancer.proc.pid}
        runs, cpu = trio.run(bench, targets, args, pids)
    print()
    print(report(runs, cpu, args))


if __name__ == "__main__":
    main()
