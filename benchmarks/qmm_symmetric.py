"""One-row quantized products of symmetric weights (every bias -2^(bits-1)
times its scale: GGUF's Q4_0, Q5_0, Q8_0, Q6_K) with the bias plane passed
as it is vs the kernels' 0-d factor (``qmatmul.symmetric_factor``: each bias
made from its scale, the plane not read).

    .venv/bin/python benchmarks/qmm_symmetric.py [--rounds 4] [--mib 256]

Each shape's product runs over enough distinct weights (``--mib`` of them)
that they come from memory, as a decode step's do, not from the caches; the
two ways alternate round by round in one process and the best of each is
printed, with the outputs checked bit-equal.  The shapes are the real
models' symmetric layers: Qwen2.5-Coder-0.5B's Q5_0 gate/up and q/k/v and
Q8_0 head, the 1.5B's Q6_K down projection and head (8 bits, the
conversion's default for Q6_K).
"""

from __future__ import annotations

import argparse
import time

import afm_core  # noqa: F401  (first: binds MLX's BLAS)

# isort: split
import mlx.core as mx

from afm_core._mlx import qmatmul as _qmatmul

SHAPES = [  # (label, K, N, bits)
    ("0.5B gate/up (Q5_0)", 896, 9728, 5),
    ("0.5B q/k/v (Q5_0)", 896, 1152, 5),
    ("0.5B head (Q8_0)", 896, 151936, 8),
    ("1.5B down (Q6_K)", 8960, 1536, 8),
    ("1.5B head (Q6_K)", 1536, 151936, 8),
]


def weights(k: int, n: int, bits: int, mib: int) -> tuple[list[tuple[mx.array, ...]], mx.array]:
    c = -(1 << (bits - 1))
    one = n * k * (bits + 2 * 16 / 32) / 8  # bytes of one weight with its float16 planes
    ws = []
    for i in range(max(2, int(mib * 2**20 / one))):
        q, s, _ = mx.quantize(mx.random.normal((n, k), key=mx.random.key(i)) * 0.05, group_size=32, bits=bits)
        s = s.astype(mx.float16)
        ws.append((q, s, s * c))
        mx.eval(ws[-1])
    return ws, mx.array(c, dtype=mx.float16)


def per_product(ws: list[tuple[mx.array, ...]], xs: list[mx.array], factor: mx.array | None, bits: int
                ) -> tuple[float, list[mx.array]]:
    ext = _qmatmul.extension()
    assert ext is not None
    outs = [ext.quantized_matmul(x, q, s, b if factor is None else factor, 32, bits)
            for x, (q, s, b) in zip(xs, ws, strict=True)]
    start = time.perf_counter()
    mx.eval(outs)
    return (time.perf_counter() - start) / len(xs) * 1e6, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256, help="weight bytes per shape (beyond the caches)")
    args = parser.parse_args()
    if _qmatmul.extension() is None:
        raise SystemExit("afm_core._mlx.qmm_ext is not built")
    print(f"kernels {_qmatmul.kernel_isa()}; one-row products, weights from memory, best of {args.rounds} rounds")
    for label, k, n, bits in SHAPES:
        ws, factor = weights(k, n, bits, args.mib)
        xs = [mx.random.normal((1, 1, k), key=mx.random.key(1000 + i)) for i in range(len(ws))]
        mx.eval(xs)
        best = {"biases": float("inf"), "factor": float("inf")}
        same = True
        for _ in range(args.rounds):
            t_b, o_b = per_product(ws, xs, None, bits)
            t_f, o_f = per_product(ws, xs, factor, bits)
            best["biases"], best["factor"] = min(best["biases"], t_b), min(best["factor"], t_f)
            same = same and all(mx.array_equal(u, v).item() for u, v in zip(o_b, o_f, strict=True))
        mb = (ws[0][0].nbytes + 2 * ws[0][1].nbytes) / 1e6
        print(f"  {label:<22} K {k:>5} N {n:>6} {bits} bits ({mb:6.1f} MB): biases {best['biases']:8.1f} us, "
              f"factor {best['factor']:8.1f} us, {best['biases'] / best['factor']:.3f}x, "
              f"{'same bits' if same else 'OUTPUTS DIFFER'}")
        del ws, xs


if __name__ == "__main__":
    main()
