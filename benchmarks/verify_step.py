"""What a forward over L positions (a speculative verify step) costs next to
a one-position decode step, with the CPU kernels for L positions and with
the one-position kernels only.

    .venv/bin/python benchmarks/verify_step.py [--model DIR] [--context 256] [--batch 1,4]
        [--positions 1,2,3,5,8] [--cache single|batch] [--rounds 3] [--repeats 6]

On the model as the engine runs it (``fuse_for_cpu``), a cache of
``--context`` tokens per row (mlx-lm's single-sequence cache, whose offset is
an int, or its batch cache, whose offsets are an array and whose masks carry
the left padding), it prints for each batch width and number of positions L:

* the forward's median wall time with the kernels taking up to
  ``MAX_QUERY_POSITIONS`` positions ("L kernels") and with them limited to one
  position, as before they took more ("1 kernels": attention and rotary
  embedding through mlx-lm's graphs at L > 1, and the rotary embedding of an
  int offset always), measured alternately in one process;
* the operations in each forward's graph.

Each forward is trimmed off the cache again, so every one sees the same
context.  Times are wall times on a shared machine: compare the two columns,
not runs.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from afm_core._mlx import attention, fusion
from afm_core._models import loader as _loader
from afm_core._models.default_model import ensure_default_model


def _limit(positions: int) -> None:
    """Kernels for up to ``positions`` query positions (1: the one-position
    kernels only, with the rotary embedding's array offsets only)."""
    attention.MAX_QUERY_POSITIONS = positions
    fusion.MAX_QUERY_POSITIONS = positions if positions > 1 else 0


def _ops(out: mx.array) -> collections.Counter[str]:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, out)
        graph = f.read()
    return collections.Counter(re.findall(r'label ?= ?"([A-Za-z][^"]*)", shape=rectangle', graph))


def _cache(model: Any, kind: str, rows: int) -> list[Any]:
    if kind == "single":
        return make_prompt_cache(model)
    return [BatchKVCache([0] * rows) for _ in model.layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="mlx-lm directory (default: the default model)")
    parser.add_argument("--context", type=int, default=256, help="tokens in the KV cache per row")
    parser.add_argument("--batch", default="1,4", help="batch widths")
    parser.add_argument("--positions", default="1,2,3,5,8", help="query positions L")
    parser.add_argument("--cache", choices=("single", "batch"), default="single")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=6, help="forwards per round and setting")
    args = parser.parse_args()
    path = Path(args.model) if args.model else ensure_default_model()
    model, _, _ = _loader.load(path)
    fusion.fuse_for_cpu(model)
    full = attention.MAX_QUERY_POSITIONS
    print(f"model {path.name}; context {args.context}; cache {args.cache}")
    print(f"{'B':>2} {'L':>3}  {'L kernels ms':>12} {'1 kernels ms':>12}  ratio  "
          f"{'ops (L kernels)':>15} {'ops (1 kernels)':>15}")
    for rows in (int(b) for b in args.batch.split(",")):
        cache = _cache(model, args.cache, rows)
        prompt = mx.array([[(7 * i) % 1000 + 10 for i in range(args.context)]] * rows)
        mx.eval(model(prompt, cache=cache), [c.state for c in cache])
        mx.eval(model(prompt[:, :1], cache=cache))  # the cache grows its buffer once, here
        for c in cache:
            c.trim(1)
        mx.eval([c.state for c in cache])
        for n in (int(p) for p in args.positions.split(",")):
            x = mx.array([[42] * n] * rows)
            times: dict[int, list[float]] = {full: [], 1: []}
            ops: dict[int, int] = {}
            for limit in (full, 1):
                _limit(limit)
                mx.eval([c.state for c in cache])  # the graph starts from a settled cache
                out = model(x, cache=cache)
                ops[limit] = sum(_ops(out).values())
                mx.eval(out)
                for c in cache:
                    c.trim(n)
            for _ in range(args.rounds):
                for _ in range(args.repeats):
                    for limit in (full, 1):
                        _limit(limit)
                        t0 = time.perf_counter()
                        mx.eval(model(x, cache=cache))
                        times[limit].append(time.perf_counter() - t0)
                        for c in cache:
                            c.trim(n)
            _limit(full)
            on, off = statistics.median(times[full]), statistics.median(times[1])
            print(f"{rows:>2} {n:>3}  {on * 1e3:12.1f} {off * 1e3:12.1f}  {on / off:5.2f}  "
                  f"{ops[full]:>15} {ops[1]:>15}")


if __name__ == "__main__":
    main()
