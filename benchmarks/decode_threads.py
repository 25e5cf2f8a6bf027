"""Which thread a decode step's time is on, and how fast one thread's products are.

    .venv/bin/python benchmarks/decode_threads.py [--model DIR] [--steps 300] [--reps 60]

1. The model as the engine runs it (afm's CPU rewrite, a float16 KV cache
   after a 64-token prompt) decodes greedily, each step's graph built while
   the one before computes (``mx.async_eval``, as mlx-lm's generator and
   the engine do).  Printed: tokens/s and the CPU each thread of the process
   used over the loop (``/proc/self/task/*/stat``), in cores: the thread
   building the graphs (Python), MLX's thread computing them, the quantized
   products' pool workers.  A thread near 1.0 core is the bound.
2. One quantized product per shape of the model's step (one row, its bits,
   float16 scales), ``--reps`` independent products in one graph, on one
   thread and on the pool (``qmm_ext.set_thread_limit``): microseconds per
   product and the weight bytes per second, with the same weights each time
   (what the caches hold of them: the kernel's own speed where they fit) and
   on the pool with the weights from memory (copies adding up to 256 MB), as
   a step reads them.  Last: those times over the step's products (each
   shape times how often a step runs it) against the loop's time a token:
   what of the step is the products, and what is everything else.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import afm_core  # noqa: F401  (first: binds MLX's BLAS)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from afm_core._mlx import half_cache
from afm_core._mlx import qmatmul as _qmatmul
from afm_core._mlx.fusion import fuse_for_cpu
from afm_core._models import loader as _loader
from afm_core._models.default_model import ensure_default_model

TICKS = os.sysconf("SC_CLK_TCK")


def thread_times() -> dict[int, tuple[str, float]]:
    """Each thread's name and CPU seconds (user + system)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / TICKS)
    return out


def decode_loop(model: nn.Module, steps: int) -> float:
    cache = half_cache.to_half(make_prompt_cache(model))
    mx.eval(model(mx.array([[1] * 64]), cache=cache))
    nxt = mx.array([[5]])
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(nxt, cache=cache)
        following = mx.argmax(logits[:, -1], axis=-1, keepdims=True)
        mx.async_eval(following)
        nxt.item()
        nxt = following
    nxt.item()
    return steps / (time.perf_counter() - start)


def product_speed(k: int, n: int, bits: int, threads: int, reps: int,
                  from_memory: bool = False) -> tuple[float, float]:
    """Microseconds and weight GB/s of one one-row product: ``reps`` of them
    in one graph, the best of 5 graphs.  ``from_memory``: the products cycle
    through copies of the weights adding up to 256 MB (at most 1,024 copies;
    at least ``reps`` products), so each reads its weights from memory, as a
    decode step does; otherwise one copy (which stays in the caches when it
    fits; one of several MB comes from the L3 or memory, as the CPU's caches
    have it)."""
    ext = _qmatmul.extension()
    assert ext is not None
    def make() -> tuple[mx.array, mx.array, mx.array]:
        w, s, b = mx.quantize(mx.random.normal((n, k)) * 0.05, group_size=32, bits=bits)
        arrays = (w, s.astype(mx.float16), b.astype(mx.float16))
        mx.eval(*arrays)
        return arrays

    weights = [make()]
    one = sum(a.nbytes for a in weights[0])
    copies = max(1, min(1024, -(-256_000_000 // one))) if from_memory else 1
    weights += [make() for _ in range(copies - 1)]
    reps = max(reps, copies)
    xs = [mx.random.normal((1, 1, k)) for _ in range(reps)]
    mx.eval(*xs)
    ext.set_thread_limit(threads)
    best = float("inf")
    for _ in range(5):
        outs = [ext.quantized_matmul(x, *weights[i % copies], 32, bits) for i, x in enumerate(xs)]
        t = time.perf_counter()
        mx.eval(outs)
        best = min(best, (time.perf_counter() - t) / reps)
    ext.set_thread_limit(0)
    return best * 1e6, one / best / 1e9


def shapes(model: nn.Module) -> list[tuple[str, int, int, int, int]]:
    """(name, K, N, bits, products a step) of each distinct quantized product of a step."""
    seen: dict[tuple[int, int, int], list] = {}
    groups: set[int] = set()
    for name, m in model.named_modules():
        group = getattr(m, "_group", None)  # a family's members run as its one product
        if group is not None:
            if id(group) in groups:
                continue
            groups.add(id(group))
            weight, bits, label = group.weight, int(group.bits), "+".join(
                n.split(".")[-1] for n, g in model.named_modules() if getattr(g, "_group", None) is group)
        elif isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            if isinstance(m, nn.QuantizedEmbedding) and getattr(model, "lm_head", None) is not None:
                continue  # a lookup, not a product, when the model has its own head
            weight, bits, label = m["weight"], int(m.bits), name.split(".")[-1]
        else:
            continue
        n, k = int(weight.shape[0]), int(weight.shape[1]) * 32 // bits
        entry = seen.setdefault((k, n, bits), [label, 0])
        entry[1] += 1
    return [(label, k, n, bits, count) for (k, n, bits), (label, count) in seen.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="mlx-lm directory or GGUF (default: the default model)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reps", type=int, default=60)
    args = parser.parse_args()
    path = Path(args.model) if args.model else ensure_default_model()
    if path.suffix == ".gguf":
        from afm_core._models.resolve import resolve_model

        path = resolve_model(str(path))
    model, _, _ = _loader.load(path)
    fuse_for_cpu(model)
    decode_loop(model, 20)  # warm-up
    main_tid = threading.get_native_id()
    before = thread_times()
    wall = time.perf_counter()
    rate = decode_loop(model, args.steps)
    wall = time.perf_counter() - wall
    after = thread_times()
    print(f"model {path.name}: {rate:.1f} tok/s over {args.steps} steps; CPU per thread, in cores:")
    for tid, (name, cpu) in sorted(after.items()):
        used = (cpu - before.get(tid, (name, 0.0))[1]) / wall
        if used >= 0.01:
            role = "building the graphs (Python)" if tid == main_tid else name
            print(f"  {tid:>8} {role:<32} {used:5.2f}")
    print("one-row products: one thread, the pool (2) with the weights in cache, the pool with them"
          " from memory (as in a step); x the products a step:")
    total = 0.0
    for name, k, n, bits, count in shapes(model):
        one = product_speed(k, n, bits, 1, args.reps)
        pool = product_speed(k, n, bits, 0, args.reps)
        memory = product_speed(k, n, bits, 0, args.reps, from_memory=True)
        total += count * memory[0]
        print(f"  {name:<24} K {k:>5} N {n:>6} {bits} bits x{count:<3}: {one[0]:8.1f} us {one[1]:5.1f} GB/s"
              f" | {pool[0]:8.1f} us {pool[1]:5.1f} GB/s | {memory[0]:8.1f} us {memory[1]:5.1f} GB/s")
    print(f"a step's products from memory on the pool: {total / 1e3:.1f} ms of the loop's {1e3 / rate:.1f} ms a token")


if __name__ == "__main__":
    main()
