"""How afm's quantized product costs grow with the rows of a decode step, per kernel set.

    .venv/bin/python benchmarks/qmm_rows.py [--rows 1,2,4,8] [--isas avx2,avx512-vnni]
        [--bits 4,6,8] [--shapes 1536x8960,8960x1536] [--rounds 6] [--reps 5]
        [--old path/to/qmm_ext*.so] [--threads 1] [--clock cpu]

Batched decode multiplies a few activation rows (one per stream) by each
weight: this times ``qmm_ext.quantized_matmul`` (16-bit activations, the
default) at Qwen2.5-Coder-1.5B's MLP shapes (K x N: 1536 x 8960 up/gate, 8960 x
1536 down), random weights in MLX's affine layout (group 32, float16 scales as
a converted GGUF has), for M = 1..8 rows, on each kernel set (``set_isa``).

Every round runs each build in a fresh process (``--old``: another build of
the extension, e.g. a copy of the .so made before a change; the two alternate,
neither always first), loaded from its file as a second copy beside the one
afm_core imports.  Compare copies of both builds made outside the checkout
(``--new``): dlopen of the checkout's own .so returns the library afm_core
already holds, whose heap and thread-local buffers lie elsewhere, and where
they lie moves these kernels by up to 25% (the same binary measured as
"new" and as a copy: 0.81-1.27).  Times are ms per call (the median of
``--reps`` calls in a process, then the median over ``--rounds``
processes); ``--clock cpu`` counts the process's CPU time (with ``--threads
1``, the default: the kernel's own time, less the time another job holds
the core).  GB/s counts the weight bytes (data, scales, biases) read once
per call; ``/M1`` is the time per row relative to one row (1.0: each row
costs a whole one-row product; 1/M: rows come free); ``old/new`` is the
speed-up, the ratio of the two medians.  Even so two copies of one build
differ by up to 8%: read a change against a kernel set it does not touch.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import afm_core  # noqa: F401  (first: binds MLX's BLAS at libmlx's load, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx

from afm_core._mlx import qmatmul as _qmatmul


def load_build(path: str) -> Any:
    """A build of the extension from its .so, loaded the same way whichever it is
    (afm_core has loaded its own copy already: every worker holds two), or the
    one afm_core imported if it is that file."""
    own = _qmatmul.extension()
    if own is not None and Path(own.__file__).resolve() == Path(path).resolve():
        return own
    loader = importlib.machinery.ExtensionFileLoader("qmm_ext", path)
    spec = importlib.util.spec_from_file_location("qmm_ext", path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def weights(k: int, n: int, bits: int) -> tuple[mx.array, mx.array, mx.array, int]:
    w = mx.random.normal((n, k), key=mx.random.key(n * 7 + k + bits)) * 0.05
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    s, b = s.astype(mx.float16), b.astype(mx.float16)
    mx.eval(q, s, b)
    return q, s, b, q.nbytes + s.nbytes + b.nbytes


def time_call(ext: Any, x: mx.array, wsb: tuple[mx.array, mx.array, mx.array], bits: int,
              reps: int, clock: Callable[[], float]) -> float:
    q, s, b = wsb
    mx.eval(ext.quantized_matmul(x, q, s, b, 32, bits))  # warm
    ts = []
    for _ in range(reps):
        t0 = clock()
        mx.eval(ext.quantized_matmul(x, q, s, b, 32, bits))
        ts.append(clock() - t0)
    return statistics.median(ts)


def worker(args: argparse.Namespace) -> None:
    """One process's times, as JSON: {"k,n,bits,isa,m": seconds}."""
    mx.set_default_device(mx.cpu)
    ext = load_build(args.so)
    ext.set_thread_limit(args.threads)
    ext.set_activation_bits(16)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    out: dict[str, float] = {}
    for k, n in shapes(args):
        for bits in [int(b) for b in args.bits.split(",")]:
            q, s, b, nbytes = weights(k, n, bits)
            out[f"{k},{n},{bits},bytes"] = nbytes
            for isa in args.isas.split(","):
                if not ext.set_isa(isa):
                    continue
                for m in rows(args):
                    x = mx.random.normal((m, k), key=mx.random.key(m))
                    out[f"{k},{n},{bits},{isa},{m}"] = time_call(ext, x, (q, s, b), bits,
                                                                 args.reps, clock)
    print(json.dumps(out))


def rows(args: argparse.Namespace) -> list[int]:
    return [int(r) for r in args.rows.split(",")]


def shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [(int(s.split("x")[0]), int(s.split("x")[1])) for s in args.shapes.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--isas", default="avx2,avx512-vnni")
    ap.add_argument("--bits", default="4,6,8")
    ap.add_argument("--shapes", default="1536x8960,8960x1536")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--old", default="", help="another build of qmm_ext (.so) to compare with")
    ap.add_argument("--new", default="", help="the build to measure (default: this checkout's; "
                    "give a copy of it elsewhere when comparing, see above)")
    ap.add_argument("--threads", type=int, default=1, help="thread limit (0: the pool's)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu",
                    help="cpu: the process's CPU time; wall: elapsed time")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--so", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    ext = _qmatmul.extension()
    if ext is None:
        sys.exit("the qmm extension is not available")
    this = str(Path(args.new or ext.__file__).resolve())  # default: this checkout's build
    builds = {"old": str(Path(args.old).resolve()), "new": this} if args.old else {"new": this}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    base = [sys.executable, __file__, "--worker", "--rows", args.rows, "--isas", args.isas,
            "--bits", args.bits, "--shapes", args.shapes, "--reps", str(args.reps),
            "--threads", str(args.threads), "--clock", args.clock]
    for rnd in range(args.rounds):
        order = list(builds.items())
        if rnd % 2:
            order.reverse()  # neither build always goes first
        for name, so in order:
            done = subprocess.run([*base, "--so", so], capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"threads {args.threads or 'all'}, {args.clock} time, builds {list(builds)}; ms per "
          f"call: medians over {args.rounds} processes of the median of {args.reps} calls")
    print(f"{'K x N':>10} {'bits':>4} {'M':>2} {'isa':>12} "
          + " ".join(f"{name + ' ms':>9} {'GB/s':>6} {'/M1':>5}" for name in builds)
          + ("  old/new" if len(builds) == 2 else ""))
    for k, n in shapes(args):
        for bits in [int(b) for b in args.bits.split(",")]:
            for isa in args.isas.split(","):
                for m in rows(args):
                    key = f"{k},{n},{bits},{isa},{m}"
                    if key not in runs["new"][0]:
                        continue
                    med: dict[str, float] = {}
                    cells = []
                    for name in builds:
                        nbytes = runs[name][0][f"{k},{n},{bits},bytes"]
                        med[name] = statistics.median(r[key] for r in runs[name])
                        one = statistics.median(r[f"{k},{n},{bits},{isa},{rows(args)[0]}"]
                                                for r in runs[name])
                        cells.append(f"{med[name] * 1e3:9.3f} {nbytes / med[name] / 1e9:6.1f} "
                                     f"{med[name] / one / (m / rows(args)[0]):5.2f}")
                    ratio = f"  {med['old'] / med['new']:7.2f}" if len(builds) == 2 else ""
                    print(f"{k:>4}x{n:<5} {bits:>4} {m:>2} {isa:>12} " + " ".join(cells) + ratio)


if __name__ == "__main__":
    main()
