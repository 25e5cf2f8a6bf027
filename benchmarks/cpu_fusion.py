"""What fusing norms and rotary embeddings does to one decode step on MLX's CPU backend.

    .venv/bin/python benchmarks/cpu_fusion.py [--model DIR] [--levels 1,8,32] [--max-tokens 256] [--repeats 5]

For mlx-lm's ``BatchGenerator`` on the same model, plain and with
``afm_core._mlx.fusion.fuse_cpu_kernels`` applied, it prints:

* the operations MLX schedules for one decode step, by primitive (counted in
  the graph handed to ``mx.async_eval``; every one is a task for the CPU
  scheduler);
* decode tokens/s at each concurrency, plain and fused alternating
  ``--repeats`` times, with the median of the paired ratios.

Greedy decoding; both sides must produce the same tokens, which is checked.
The default model is the random tiny test model (float32).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import afm_core  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx

from afm_core._mlx.batch import install
from afm_core._mlx.fusion import fuse_cpu_kernels, unfuse_cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_model, paired_rates


def _prompts(tok: Any, n: int) -> list[list[int]]:
    words = "the quick brown fox jumps over a lazy dog while local inference streams tokens".split()
    return [tok.apply_chat_template([{"role": "user", "content": " ".join(words[: 4 + i % 10])}],
                                    add_generation_prompt=True) for i in range(n)]


def _generator(model: Any, c: int) -> Any:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=c, prefill_batch_size=min(8, c))
    install(gen, set())
    return gen


def census(model: Any, tok: Any, c: int) -> collections.Counter[str]:
    """Primitives in the graph of one decode step at concurrency ``c``."""
    gen = _generator(model, c)
    gen.insert(_prompts(tok, c), max_tokens=[16] * c)
    for _ in range(4):
        gen.next_generated()
    real = mx.async_eval
    graphs: list[str] = []

    def capture(*arrays: Any) -> None:
        if not graphs:
            flat: list[mx.array] = []
            stack = list(arrays)
            while stack:
                a = stack.pop()
                if isinstance(a, mx.array):
                    flat.append(a)
                elif isinstance(a, (list, tuple)):
                    stack.extend(a)
            with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
                mx.export_to_dot(f.name, *flat)
                graphs.append(f.read())
        real(*arrays)

    mx.async_eval = capture
    try:
        gen.next_generated()
    finally:
        mx.async_eval = real
    gen.close()
    labels = re.findall(r'label ?= ?"([A-Za-z][^"]*)", shape=rectangle', graphs[0])
    return collections.Counter(labels)


def decode_rate(model: Any, tok: Any, c: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    gen = _generator(model, c)
    prompts = _prompts(tok, c)
    t0 = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[max_tokens] * c)
    out: dict[int, list[int]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    dt = time.perf_counter() - t0
    gen.close()
    return c * max_tokens / dt, [out[u] for u in uids]


def fused_decode_rate(model: Any, tok: Any, c: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """:func:`decode_rate` with the fused kernels switched on for the run."""
    fuse_cpu_kernels(model)
    try:
        return decode_rate(model, tok, c, max_tokens)
    finally:
        unfuse_cpu_kernels(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model, tok, path = load_model(args.model)
    print(f"model: {path}  device: {mx.default_device()}\n")

    plain = census(model, tok, 1)
    layers = fuse_cpu_kernels(model)
    fused = census(model, tok, 1)
    unfuse_cpu_kernels(model)
    print(f"operations in one decode step (C=1): plain {sum(plain.values())}, "
          f"fused {sum(fused.values())} ({layers} layers fused)")
    for name in sorted(set(plain) | set(fused), key=lambda k: -(plain[k] + fused[k])):
        print(f"  {plain[name]:>4} {fused[name]:>4}  {name}")

    print(f"\n{'C':>4} {'plain tok/s':>12} {'fused tok/s':>12} {'ratio':>6}  (medians)")
    for c in [int(x) for x in args.levels.split(",")]:
        columns = paired_rates(args.repeats, partial(decode_rate, model, tok, c, args.max_tokens),
                               partial(fused_decode_rate, model, tok, c, args.max_tokens),
                               f"C={c}: fused decoding")
        print(f"{c:>4} {columns}")

if __name__ == "__main__":
    main()
