"""How long a long prompt arriving pauses the streams already decoding.

    .venv/bin/python benchmarks/prefill_stall.py [--model default|random|DIR] [--prompt 8000]
        [--streams 1] [--settings 0,256] [--rounds 2]

For each ``prefill_step_decoding`` setting (0: mlx-lm's behaviour, every step
prefills a chunk of ``prefill_step`` = 2048 tokens; N: chunks of about N
tokens' cost while streams decode, ``afm_core._mlx.prefill``) the engine
(defaults otherwise, prefix cache off) runs ``--streams`` greedy streams;
once they decode, a prompt of ``--prompt`` tokens (raw ids) arrives asking
for one token.  Printed per setting, medians over ``--rounds``: the running
streams' gaps between tokens before it arrived (p50), while it was being
prefilled (p50, p99, max: every gap from its arrival to its first token),
and its time to first token.  Settings alternate round by round on a shared
machine; each round opens its own engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import model_path  # (first: imports afm_core before mlx)

# isort: split
import trio

from afm_core import CompletionRequest, ContentDelta, Finish, LogprobsDelta, open_engine


def raw(ids: list[int], max_tokens: int) -> CompletionRequest:
    return CompletionRequest.from_openai({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                                         tuple(ids))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one_round(model: Path, setting: int, prompt: int, streams: int) -> dict[str, float]:
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 30000)
    top = min(int(vocab) - 16, 30000) - 100  # (ids from 100: no special tokens)
    long_ids = [100 + (i * 7919 + 13) % top for i in range(prompt)]
    async with open_engine(model, prefill_step_decoding=setting, prefix_cache_bytes=0) as engine:
        decoding = trio.Event()
        done = trio.Event()

        async def running(i: int) -> None:
            ids = [long_ids[(7 * i + j) % len(long_ids)] for j in range(4)]
            async with engine.stream(raw(ids, 3000), request_id=f"running-{i}") as s:
                async for e in s:
                    if isinstance(e, ContentDelta | LogprobsDelta):
                        arrivals[i].append(time.perf_counter())
                        if all(len(a) >= 8 for a in arrivals):
                            decoding.set()
                    if done.is_set():
                        return

        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(running, i)
            await decoding.wait()
            t0 = time.perf_counter()
            async with engine.stream(raw(long_ids, 1)) as s:
                async for e in s:
                    if isinstance(e, ContentDelta | LogprobsDelta | Finish):
                        break
            t1 = time.perf_counter()
            done.set()
            for i in range(streams):
                engine.cancel(f"running-{i}")
    before, during = [], []
    for times in arrivals:
        gaps = list(itertools.pairwise(times))
        before += [b - a for a, b in gaps if b <= t0]
        during += [b - a for a, b in gaps if b > t0 and a < t1]
    return {"before_p50": pct(before, 0.5), "p50": pct(during, 0.5), "p99": pct(during, 0.99),
            "max": max(during, default=float("nan")), "ttft": t1 - t0, "gaps": len(during)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt", type=int, default=8000)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--settings", default="0,256")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    path = model_path(args.model, Path(tempfile.mkdtemp()))
    settings = [int(x) for x in args.settings.split(",")]
    print(f"model: {path}; a {args.prompt}-token prompt arriving while {args.streams} stream(s) decode\n")
    rows: dict[int, list[dict[str, float]]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for setting in settings if r % 2 == 0 else settings[::-1]:
            got = trio.run(one_round, path, setting, args.prompt, args.streams)
            rows[setting].append(got)
            print(f"  round {r + 1} prefill_step_decoding={setting}: gaps p50 {got['p50']:.3f} s "
                  f"p99 {got['p99']:.3f} s max {got['max']:.3f} s ({got['gaps']:.0f}), "
                  f"TTFT {got['ttft']:.1f} s", flush=True)
    print(f"\n{'prefill_step_decoding':>21} {'gap before':>11} {'p50':>8} {'p99':>8} {'max':>8} {'TTFT':>8}"
          "   (seconds, medians over rounds)")
    for setting in settings:
        def med(k: str, setting: int = setting) -> float:
            return statistics.median(x[k] for x in rows[setting])
        print(f"{setting:>21} {med('before_p50'):11.3f} {med('p50'):8.3f} {med('p99'):8.3f} "
              f"{med('max'):8.3f} {med('ttft'):8.1f}")


if __name__ == "__main__":
    main()
