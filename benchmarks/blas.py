"""The engine on the default model with OpenBLAS under MLX vs MLX's reference BLAS.

    .venv/bin/python benchmarks/blas.py [--rounds 3] [--prompt-tokens 512] [--max-tokens 128]

Each round starts one engine per setting in a fresh process (the BLAS is
bound once per process), alternating their order, and measures through the
engine's own profile (``X-AFM-Profile``'s numbers):

* TTFT of a ``--prompt-tokens`` prompt (its own words each time, so the
  prefix cache never serves it), after the engine's start-up warm-up;
* single-stream greedy decode tokens/s over ``--max-tokens`` tokens;
* the first request's TTFT on a short prompt right after start (warm start).

Settings: ``openblas`` (the default: afm_core._mlx.blas binds scipy-openblas32)
and ``reference`` (``AFM_BLAS=reference``: the wheel's netlib BLAS, with the
transposed-weight layout that suits it, i.e. afm before the binding).
Medians over the rounds and the ratio openblas / reference are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

SETTINGS = {"openblas": {}, "reference": {"AFM_BLAS": "reference"}}

_CHILD = r"""
import json, random, sys, time
import trio
import afm_core
from afm_core import ChatRequest, Profile, open_engine
from afm_core._models.default_model import ensure_default_model

seed, prompt_tokens, max_tokens = (int(a) for a in sys.argv[1:4])
WORDS = ("river mountain lantern harbor copper meadow violin glacier orchard falcon "
         "pepper canyon marble thunder saddle velvet compass ember willow quartz").split()

def request(text, n):
    return ChatRequest.from_openai({"messages": [{"role": "user", "content": text}],
                                    "max_tokens": n, "temperature": 0})

async def profiled(engine, text, n):
    async with engine.stream(request(text, n), profile="basic") as s:
        return [e for e in [e async for e in s] if isinstance(e, Profile)][0].payload

async def main():
    path = ensure_default_model()
    t0 = time.perf_counter()
    async with open_engine(path) as engine:
        out = {"start_s": time.perf_counter() - t0, "blas": engine.statistics().blas}
        first = await profiled(engine, "Write three sentences about Paris.", 4)
        out["first_ttft_s"] = first["ttft_s"]
        rng = random.Random(seed)
        tok = engine._tokenizer
        words = []
        while len(tok.encode(" ".join(words))) < prompt_tokens - 30:  # the template adds ~30
            words.append(rng.choice(WORDS))
        long = await profiled(engine, " ".join(words) + ". Summarize.", 1)
        out.update(long_ttft_s=long["ttft_s"], long_prompt_tokens=long["prompt_tokens"])
        story = await profiled(engine, f"Tell a long story about a {rng.choice(WORDS)}.", max_tokens)
        out.update(decode_tok_s=story["decode_tok_s"], completion_tokens=story["completion_tokens"])
    print(json.dumps(out))

trio.run(main)
"""


def run(setting: str, seed: int, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFM_BLAS")}
    env.update(SETTINGS[setting])
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(seed), str(args.prompt_tokens), str(args.max_tokens)],
        capture_output=True, text=True, env=env, check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{setting} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        seed = random.randrange(1 << 30)
        for setting in order:
            out = run(setting, seed, args)
            results[setting].append(out)
            print(f"round {r + 1} {setting:9s} ({out['blas']}): "
                  f"{args.prompt_tokens}-token TTFT {out['long_ttft_s'] * 1e3:8.0f} ms, "
                  f"decode {out['decode_tok_s']:6.2f} tok/s ({out['completion_tokens']} tokens), "
                  f"first request TTFT {out['first_ttft_s'] * 1e3:6.0f} ms, "
                  f"start {out['start_s']:.1f} s", flush=True)
    print()
    med = {s: {k: statistics.median(o[k] for o in rs) for k in
               ("long_ttft_s", "decode_tok_s", "first_ttft_s", "start_s")}
           for s, rs in results.items()}
    print(f"{'median':10s} {'TTFT ' + str(args.prompt_tokens) + ' tok':>14s} {'decode tok/s':>13s} "
          f"{'first TTFT':>11s} {'start':>7s}")
    for s, m in med.items():
        print(f"{s:10s} {m['long_ttft_s'] * 1e3:11.0f} ms {m['decode_tok_s']:13.2f} "
              f"{m['first_ttft_s'] * 1e3:8.0f} ms {m['start_s']:5.1f} s")
    o, ref = med["openblas"], med["reference"]
    print(f"openblas / reference: TTFT {ref['long_ttft_s'] / o['long_ttft_s']:.1f}x faster, "
          f"decode {o['decode_tok_s'] / ref['decode_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
