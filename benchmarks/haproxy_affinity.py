"""Conversation affinity through HAProxy: prefix-cache reuse with and without ``X-Session-ID``.

    .venv/bin/python benchmarks/haproxy_affinity.py [--model random|default|DIR]
        [--sessions 24] [--turns 4] [--concurrency 6] [--document-words 300]

Three ``afm serve`` replicas behind the ``afm deploy haproxy`` configuration
(tests/deploy/cluster.py), fresh for each mode.  A multi-turn workload: each
session has its own document as the system prompt and ``--turns`` user
turns, each turn sent with the whole history (the previous replies
included), ``max_tokens`` 16, sessions run ``--concurrency`` at a time.
Mode ``ids``: no session header, every request balanced on its own
(HAProxy-made) request id; mode ``session``: every turn carries
``X-Session-ID``.  Reported from the replicas' ``/metrics`` (summed over the
three): prefix-cache hits per lookup, the share of prompt tokens served from
the cache (the figure that matters: prefill skipped), and on the client side
how many follow-up turns landed on the replica that served the turn before,
and the follow-up turns' median latency.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import afm_core  # noqa: F401  (first: binds MLX's BLAS)

# isort: split
import argparse
import random
import re
import statistics
import time

import httpx
import trio
from _common import model_path

from afm_core.bench._workload import make_prompt
from tests.deploy.cluster import Cluster, haproxy_binary

COUNTERS = ("afm_prefix_cache_hits_total", "afm_prefix_cache_lookups_total",
            "afm_cached_prompt_tokens_total", "afm_prompt_tokens_total")


def counters(cluster: Cluster) -> dict[str, float]:
    total = dict.fromkeys(COUNTERS, 0.0)
    for r in cluster.replicas:
        text = httpx.get(r.url + "/metrics", timeout=10).text
        for name in COUNTERS:
            m = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
            total[name] += float(m.group(1)) if m else 0.0
    return total


async def run_mode(cluster: Cluster, mode: str, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    docs = [make_prompt(rng, args.document_words) for _ in range(args.sessions)]
    same_replica = follow_ups = 0
    latencies: list[float] = []
    limiter = trio.CapacityLimiter(args.concurrency)
    async with httpx.AsyncClient(base_url=cluster.balancer.url, timeout=120) as client:

        async def session(s: int) -> None:
            nonlocal same_replica, follow_ups
            async with limiter:
                history = [{"role": "system", "content": f"Document {s}: {docs[s]}"}]
                previous = None
                turn_rng = random.Random(args.seed * 1000 + s)
                for t in range(args.turns):
                    history.append({"role": "user", "content": make_prompt(turn_rng, 20)})
                    headers = {"X-Session-ID": f"session-{s}"} if mode == "session" else {}
                    t0 = time.perf_counter()
                    r = await client.post("/v1/chat/completions", headers=headers,
                                          json={"messages": history, "max_tokens": 16})
                    r.raise_for_status()
                    replica = r.headers["x-afm-replica"]
                    if t > 0:
                        follow_ups += 1
                        same_replica += replica == previous
                        latencies.append(time.perf_counter() - t0)
                    previous = replica
                    history.append({"role": "assistant",
                                    "content": r.json()["choices"][0]["message"]["content"]})

        before = await trio.to_thread.run_sync(counters, cluster)
        async with trio.open_nursery() as nursery:
            for s in range(args.sessions):
                nursery.start_soon(session, s)
        after = await trio.to_thread.run_sync(counters, cluster)
    d = {k: after[k] - before[k] for k in COUNTERS}
    return {
        "requests": d["afm_prefix_cache_lookups_total"],
        "hit_rate": d["afm_prefix_cache_hits_total"] / d["afm_prefix_cache_lookups_total"],
        "cached_share": d["afm_cached_prompt_tokens_total"] / d["afm_prompt_tokens_total"],
        "prompt_tokens": d["afm_prompt_tokens_total"],
        "same_replica": same_replica / follow_ups,
        "follow_up_ms": 1000 * statistics.median(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random", help="random (tiny test model), default, or DIR")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--document-words", type=int, default=300)
    parser.add_argument("--seed", type=int, default=19)
    args = parser.parse_args()
    if haproxy_binary() is None:
        raise SystemExit("haproxy is not installed (apt-get install haproxy / brew install haproxy)")
    work = Path(tempfile.mkdtemp(prefix="afm-affinity-bench-"))
    model = model_path(args.model, work)
    results = {}
    for mode in ("ids", "session"):
        with Cluster(model, work / mode, 3, replica_env={"AFM_BLAS_THREADS": "1"}) as cluster:
            results[mode] = trio.run(run_mode, cluster, mode, args)
        r = results[mode]
        print(f"{mode:>8}: {r}", flush=True)
    print(f"\n{args.sessions} sessions x {args.turns} turns, 3 replicas, model {args.model}, "
          f"{args.document_words}-word document per session")
    print("| balanced on | prefix-cache hits / lookups | prompt tokens from the cache | "
          "follow-up turns on the previous turn's replica | follow-up turn latency p50 |")
    print("| --- | --- | --- | --- | --- |")
    for mode, label in (("ids", "request id (no affinity)"), ("session", "X-Session-ID")):
        r = results[mode]
        print(f"| {label} | {r['hit_rate']:.1%} | {r['cached_share']:.1%} | "
              f"{r['same_replica']:.1%} | {r['follow_up_ms']:.0f} ms |")


if __name__ == "__main__":
    main()
