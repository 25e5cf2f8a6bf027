"""How asynchronous ``mx.async_eval`` is on this machine's MLX backend.

    .venv/bin/python benchmarks/mlx_async_eval.py [--ops 6,15,30,60,150,300] [--size 64] [--repeats 5]

Builds a chain of N small element-wise operations, then times the
``mx.async_eval`` call itself and the ``mx.eval`` wait that follows.  On the
CPU backend every primitive is one scheduler task and MLX's evaluator stops
enqueueing while more than a handful (``MAX_ACTIVE_TASKS``, 10 in MLX's
``transforms.cpp``) are in flight, so ``async_eval`` returns only when all
but the last few operations have run: the time moves from the wait into the
call as N grows.  mlx-lm's decode step relies on ``async_eval`` to overlap
the next step's computation with Python work; this shows how little of that
overlap the CPU backend leaves (a decode step is a few hundred operations).
"""

from __future__ import annotations

import argparse
import statistics
import time

import afm_core  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx


def measure(n_ops: int, size: int, repeats: int) -> tuple[float, float]:
    """Median microseconds of (the async_eval call, the eval wait after it)."""
    x = mx.ones((size, size))
    mx.eval(x)
    calls, waits = [], []
    for _ in range(repeats):
        y = x
        for _ in range(n_ops // 3):  # three primitives per round
            y = mx.exp(y * 0.5) - 0.3
        t0 = time.perf_counter()
        mx.async_eval(y)
        t1 = time.perf_counter()
        mx.eval(y)
        t2 = time.perf_counter()
        calls.append(t1 - t0)
        waits.append(t2 - t1)
    return statistics.median(calls) * 1e6, statistics.median(waits) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="6,15,30,60,150,300", help="primitives per graph, comma list")
    ap.add_argument("--size", type=int, default=64, help="side of the square float32 operand")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    print(f"{'ops':>5} {'async_eval us':>14} {'then wait us':>13} {'share in call':>14}")
    for n in [int(v) for v in args.ops.split(",")]:
        call, wait = measure(n, args.size, args.repeats)
        print(f"{n:>5} {call:>14.0f} {wait:>13.0f} {call / (call + wait):>14.0%}")


if __name__ == "__main__":
    main()
