"""A running stream's inter-token gaps while a large embedding request runs.

Each target is an ``afm serve`` (a fresh process, its own port) on the same
model; per round, every target in turn: a streamed completion decodes
(``ignore_eos``), and once it is under way a ``/v1/embeddings`` request of
``--inputs`` texts of ``--chars`` characters each is sent; the arrival times
of the stream's chunks while the embedding request runs give the gaps (p50,
p99, max), next to the stream's gaps before it started and the embedding
request's own time.  Targets are an ``afm`` of some Python environment
(``LABEL=PYTHON``: another checkout's venv gives the "before"; the server
starts in the checkout that holds the venv, so it runs that checkout's code)
with extra ``afm serve`` flags after it (``LABEL=PYTHON --embedding-step 64``)::

    .venv/bin/python benchmarks/embedding_gap.py \\
        --target before=../afm-before/.venv/bin/python \\
        --target step512=.venv/bin/python \\
        --target "step128=.venv/bin/python --embedding-step 128" --rounds 3

Timings depend on the machine and on what else runs on it: compare the
targets of one run (they alternate), not runs on different days.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = ("alpha", "beta", "7", "gamma", "delta", "42", "x", "omega", "river", "stone", "light", "quiet",
         "seven", "orbit", "maple", "node", "tide", "glass", "Zürich", "naïve", "3.14", "{", "}", ":")


@dataclass
class Target:
    label: str
    argv: list[str]
    url: str = ""
    proc: subprocess.Popen[str] | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)


def _texts(n: int, chars: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < chars:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words)[:chars])
    return out


def _start(target: Target, model: str | None) -> None:
    argv = [*target.argv[:1], "-m", "afm_core._cli", "serve", "--port", "0", "--quiet", "--no-ui",
            *(["--model", model] if model else []), *target.argv[1:]]
    python = Path(target.argv[0]).absolute()
    checkout = python.parents[2] if python.parent.parent.name == ".venv" else Path.cwd()
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=checkout)
    assert proc.stderr is not None
    deadline = time.monotonic() + 600
    for line in proc.stderr:
        if m := re.search(r"serving .* on (http://[\d.]+:\d+)", line):
            target.url, target.proc = m.group(1), proc
            return
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit(f"{target.label}: afm serve did not start")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _round(target: Target, texts: list[str], warm_tokens: int) -> dict[str, Any]:
    arrivals: list[float] = []
    window: dict[str, float] = {}
    usage: dict[str, Any] = {}
    def embed() -> None:
        window["start"] = time.perf_counter()
        r = httpx.post(target.url + "/v1/embeddings", json={"input": texts}, timeout=3600)
        window["end"] = time.perf_counter()
        r.raise_for_status()
        usage.update(r.json()["usage"])

    thread = None
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=3600) as c, c.stream("POST", target.url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{target.label}: the stream got {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.perf_counter())
            if len(arrivals) == warm_tokens:
                thread = threading.Thread(target=embed)
                thread.start()
            if "end" in window:
                break
    if thread is None:
        raise SystemExit(f"{target.label}: the stream ended after {len(arrivals)} tokens")
    thread.join()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    during = [b - a for a, b in itertools.pairwise(arrivals) if a >= window["start"] and b <= window["end"]]
    before = gaps[: max(warm_tokens - 2, 1)]
    return {"embed_s": round(window["end"] - window["start"], 3), "embed_tokens": usage.get("prompt_tokens"),
            "tokens_during": len(during) + 1, "gap_before_p50_ms": round(1000 * _pct(before, 0.5), 1),
            "gap_p50_ms": round(1000 * _pct(during, 0.5), 1), "gap_p99_ms": round(1000 * _pct(during, 0.99), 1),
            "gap_max_ms": round(1000 * max(during, default=float("nan")), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="append", required=True, metavar="LABEL=PYTHON [FLAGS]",
                   help="an afm to measure: the Python that runs it, then afm serve flags")
    p.add_argument("--model", default=None, help="the served model (default: afm's default model)")
    p.add_argument("--inputs", type=int, default=16)
    p.add_argument("--chars", type=int, default=4096)
    p.add_argument("--warm-tokens", type=int, default=30, help="stream tokens before the embedding request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    targets = []
    for spec in args.target:
        label, _, rest = spec.partition("=")
        targets.append(Target(label, shlex.split(rest)))
    texts = _texts(args.inputs, args.chars, seed=0)
    try:
        for t in targets:
            _start(t, args.model)
            httpx.post(t.url + "/v1/embeddings", json={"input": "warm up"}, timeout=600).raise_for_status()
        for n in range(args.rounds):
            for t in targets:
                result = _round(t, texts, args.warm_tokens)
                t.rounds.append(result)
                print(f"round {n + 1} {t.label}: {json.dumps(result)}", file=sys.stderr, flush=True)
    finally:
        for t in targets:
            if t.proc is not None:
                t.proc.kill()
    summary = {}
    for t in targets:
        rows = t.rounds

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        summary[t.label] = {k: med(k) for k in ("embed_s", "embed_tokens", "tokens_during", "gap_before_p50_ms",
                                                "gap_p50_ms", "gap_p99_ms", "gap_max_ms")}
    print(f"{'target':<12} {'embed s':>8} {'tokens':>7} {'during':>7} {'gap p50 before':>15} "
          f"{'gap p50':>8} {'gap p99':>8} {'gap max':>8}   (medians over {args.rounds} rounds; ms)")
    for label, s in summary.items():
        print(f"{label:<12} {s['embed_s']:>8.2f} {s['embed_tokens']:>7.0f} {s['tokens_during']:>7.0f} "
              f"{s['gap_before_p50_ms']:>15.1f} {s['gap_p50_ms']:>8.1f} {s['gap_p99_ms']:>8.1f} {s['gap_max_ms']:>8.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "rounds": {t.label: t.rounds for t in targets}},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
