"""mlx-lm's padded prefill against the engine's unpadded one, on the bench workload.

    .venv/bin/python benchmarks/prefill.py [--model DIR] [--levels 8,32,64] [--requests-per-slot 4] [--repeats 3]

For each concurrency C it runs the same closed loop twice per repeat, once
with mlx-lm's ``BatchGenerator`` and once with the engine's
``afm_core._mlx.prefill.EngineBatchGenerator`` (both with the engine's CPU
kernels, as the engine runs): C streams at a time, each finished stream
replaced by the next prompt in the same step, 4 x C requests of
``afm bench``'s default workload (seed 0: chat prompts of 16-64 words,
64 greedy completion tokens).  It prints:

* the prompt rows each computes (mlx-lm computes each group to its longest
  prompt; the engine computes every prompt at its own length);
* tokens/s of both and the median of the paired ratios.

Both must produce the same tokens, which is checked.  The default model is the
random tiny test model (float32).

Long prompts against llama.cpp on the same GGUF (time to first token and
peak RSS, each measurement in a process of its own, afm and llama.cpp
alternating; see ``_long_prompt.py``)::

    .venv/bin/python benchmarks/prefill.py --long 512,4096,8000 [--model default|DIR] [--gguf FILE]
        [--rounds 2] [--threads 2]

``--model default`` (the default with ``--long``) pairs afm's default model
with the GGUF it was converted from; another directory needs ``--gguf``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import Any

import afm_core  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx

from afm_core._mlx.fusion import fuse_for_cpu
from afm_core._mlx.prefill import EngineBatchGenerator
from afm_core.bench._workload import make_workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_model, paired_rates


class Counting:
    """``model``, counting the prompt rows it computes (calls of more than one token per row)."""

    def __init__(self, model: Any):
        self.model = model
        self.prompt_rows = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: Any = None, **kw: Any) -> Any:
        if inputs.shape[1] > 1:
            self.prompt_rows += inputs.shape[0] * inputs.shape[1]
        return self.model(inputs, cache=cache, **kw)


def closed_loop(model: Any, prompts: list[list[int]], max_tokens: list[int], c: int,
                engine: bool) -> tuple[float, list[list[int]]]:
    from mlx_lm.generate import BatchGenerator

    kw: dict[str, Any] = {"stop_tokens": [], "completion_batch_size": c, "prefill_batch_size": min(8, c)}
    gen = EngineBatchGenerator(model, logprob_uids=set(), **kw) if engine else BatchGenerator(model, **kw)
    waiting = deque(range(len(prompts)))
    out: dict[int, list[int]] = {}
    row: dict[int, int] = {}
    t0 = time.perf_counter()
    while waiting or row:
        while waiting and len(row) < c:
            i = waiting.popleft()
            (uid,) = gen.insert([prompts[i]], max_tokens=[max_tokens[i]])
            row[uid] = i
            out[i] = []
        _, responses = gen.next()
        for r in responses:
            out[row[r.uid]].append(r.token)
            if r.finish_reason is not None:
                del row[r.uid]
    dt = time.perf_counter() - t0
    gen.close()
    return sum(map(len, out.values())) / dt, [out[i] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--levels", default="8,32,64")
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--long", default="", help="prompt lengths: TTFT and RSS against llama.cpp")
    ap.add_argument("--gguf", type=Path, default=None, help="llama.cpp's GGUF (with --long)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.long:
        long_prompts(args)
        return
    model, tok, path = load_model(args.model)
    fuse_for_cpu(model)
    print(f"model: {path}  device: {mx.default_device()}\n")
    print(f"{'C':>4} {'prompt rows mlx-lm':>19} {'engine':>8} {'mlx-lm tok/s':>12} {'engine tok/s':>12} "
          f"{'ratio':>6}  (medians)")
    for c in [int(x) for x in args.levels.split(",")]:
        jobs = make_workload(0, args.requests_per_slot * c).jobs
        prompts = [list(tok.apply_chat_template([dict(m) for m in j.messages], add_generation_prompt=True))
                   for j in jobs]
        max_tokens = [j.max_tokens for j in jobs]
        rows = {}
        for engine in (False, True):
            counting = Counting(model)
            closed_loop(counting, prompts, max_tokens, c, engine)
            rows[engine] = counting.prompt_rows
        columns = paired_rates(
            args.repeats, partial(closed_loop, model, prompts, max_tokens, c, False),
            partial(closed_loop, model, prompts, max_tokens, c, True),
            f"C={c}: the engine's prefill")
        print(f"{c:>4} {rows[False]:>19} {rows[True]:>8} {columns}")

def long_prompts(args: argparse.Namespace) -> None:
    from _long_prompt import compare

    from afm_core import resolve_model
    from afm_core._models.default_model import GGUF_NAME, afm_home

    if args.model is None:
        model = Path(resolve_model(None))
        gguf = args.gguf or afm_home() / "downloads" / GGUF_NAME
    else:
        model, gguf = args.model, args.gguf
        if gguf is None:
            raise SystemExit("--long with --model DIR needs --gguf FILE (the same weights for llama.cpp)")
    lengths = [int(x) for x in args.long.split(",")]
    print(f"afm: {model}\nllama.cpp: {gguf}\n{args.threads} threads each, {args.rounds} rounds, "
          f"interleaved; load average now {os.getloadavg()[0]:.1f}\n")
    compare(str(model), str(gguf), lengths, args.rounds, args.threads)


if __name__ == "__main__":
    main()
