"""Quantized products on MLX's CPU backend: float32 BLAS vs mx.quantized_matmul
vs afm_core._mlx.qmm_ext, then the default model's greedy decode with each.

    .venv/bin/python benchmarks/qmatmul.py [--rows 1,8,128,512] [--tokens 64]
        [--skip-products] [--skip-decode]

Products (ms, median, the variants interleaved in one run, 4-bit group 32 as the
GGUF Q4_1 import gives, and 8-bit group 32) at the default model's shapes:
``x @ W.T`` and ``x @ Wt`` (float32, W as stored / a contiguous transpose),
MLX's quantized matmul and afm's.  MLX's quantized product is skipped where it
takes seconds (the output head from 128 rows).

Decode: SmolLM2-135M (``afm fetch-default``'s GGUF) as float32 (the current
default on the CPU), as converted with its Q4_1 weights kept (MLX 4-bit, group
32) through MLX's product and through afm's, and requantized to 8 bits (group
32) through afm's; every model with afm's CPU layer rewrite
(``fuse_cpu_kernels``), greedy, one token per step, the variants alternating
over ``--rounds``.  Tokens are compared with float32's on a few prompts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import afm_core  # noqa: F401  (first: binds MLX's BLAS at libmlx's load, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx
import mlx.nn as nn

from afm_core._mlx import qmatmul as _qmatmul
from afm_core._mlx import qmm_layers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median_seconds

SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 192), (576, 49152)]
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
]


def _ms(fn: Callable[[], object], reps: int) -> float:
    return median_seconds(fn, reps) * 1e3


def products(rows_list: list[int]) -> None:
    ext = _qmatmul._ext
    print(f"afm kernels: {_qmatmul.kernel_isa()}, threads "
          f"{ext.num_threads() if ext else '-'}; ms, median")
    print(f"{'K x N':>12} {'rows':>5} {'bits':>4} {'x@W.T':>8} {'x@Wt':>8} "
          f"{'mlx q':>8} {'afm q':>8}  afm vs f32 best")
    for k, n in SHAPES:
        w = mx.random.normal((n, k)) * 0.05
        wt = mx.contiguous(w.T)
        quants = {bits: mx.quantize(w, group_size=32, bits=bits) for bits in (4, 8)}
        mx.eval(w, wt, quants)
        for rows in rows_list:
            x = mx.random.normal((rows, k))
            mx.eval(x)
            big = rows * n * k
            reps = 3 if big > 5e8 else 10 if big > 5e7 else 30
            f32 = _ms(lambda x=x, w=w: mx.eval(x @ w.T), reps)
            f32t = _ms(lambda x=x, wt=wt: mx.eval(x @ wt), reps)
            for bits, (q, s, b) in quants.items():
                def mlx_q(x=x, q=q, s=s, b=b, bits=bits) -> None:
                    mx.eval(mx.quantized_matmul(x, q, s, b, group_size=32, bits=bits))

                def afm_q(x=x, q=q, s=s, b=b, bits=bits) -> None:
                    mx.eval(_qmatmul.quantized_matmul(x, q, s, b, group_size=32, bits=bits))

                mq = _ms(mlx_q, max(1, reps // 3)) if big < 2e9 else float("nan")
                aq = _ms(afm_q, reps)
                print(f"{k:>5} x {n:<5} {rows:>5} {bits:>4} {f32:8.3f} {f32t:8.3f} "
                      f"{mq:8.2f} {aq:8.3f}  {min(f32, f32t) / aq:5.2f}x")


def _greedy(model: nn.Module, ids: list[int], steps: int) -> tuple[list[int], float]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[:, -1]
    tok = mx.argmax(logits, axis=-1)
    mx.eval(tok)
    out = [int(tok.item())]
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        logits = model(tok.reshape(1, 1), cache=cache)[:, -1]
        tok = mx.argmax(logits, axis=-1)
        mx.eval(tok)
        out.append(int(tok.item()))
    return out, (steps - 1) / (time.perf_counter() - t0)


def decode(tokens: int, rounds: int) -> None:
    from mlx_lm.utils import load_model, load_tokenizer

    from afm_core._mlx.fusion import fuse_cpu_kernels
    from afm_core._models.default_model import default_model_dir, fetch_default_gguf
    from afm_core._models.gguf.convert import convert_gguf

    gguf = fetch_default_gguf()
    f32_dir = default_model_dir(dequantize=True)
    tmp = Path(tempfile.mkdtemp(prefix="afm-qmm-"))
    if not (f32_dir / "config.json").exists():
        f32_dir = convert_gguf(gguf, tmp / "f32", dequantize=True)
    q_dir = convert_gguf(gguf, tmp / "q4", dequantize=False)
    tokenizer = load_tokenizer(f32_dir)

    def load(path: Path, *, afm: bool, requantize: int | None = None) -> nn.Module:
        model, _ = load_model(path)
        if requantize:
            nn.quantize(model, group_size=32, bits=requantize)
            mx.eval(model.parameters())
        fuse_cpu_kernels(model)
        if not afm:
            qmm_layers.restore_qmm(model)
        return model

    models = {
        "float32": load(f32_dir, afm=False),
        "q4 mlx": load(q_dir, afm=False),
        "q4 afm": load(q_dir, afm=True),
        "q8 afm": load(f32_dir, afm=True, requantize=8),
    }
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    speeds: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            _, tps = _greedy(models[name], prompt_ids[0], tokens)
            speeds[name].append(tps)
    print(f"\ndecode, {tokens} greedy tokens, tok/s (median of {rounds} rounds, alternating)")
    base = statistics.median(speeds["float32"])
    for name, values in speeds.items():
        med = statistics.median(values)
        print(f"  {name:8s} {med:7.1f} tok/s  {med / base:5.2f}x float32   "
              f"rounds {' '.join(f'{v:.1f}' for v in values)}")
    print(f"\ngreedy agreement with float32 ({tokens} tokens per prompt)")
    ref = {p: _greedy(models["float32"], ids, tokens)[0] for p, ids in zip(PROMPTS, prompt_ids, strict=True)}
    for name in models:
        if name == "float32":
            continue
        cells = []
        for p, ids in zip(PROMPTS, prompt_ids, strict=True):
            got = _greedy(models[name], ids, tokens)[0]
            same = next((i for i, (a, b) in enumerate(zip(got, ref[p], strict=True)) if a != b), tokens)
            cells.append(f"{same}/{tokens}")
        print(f"  {name:8s} identical prefix per prompt: {' '.join(cells)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,128,512")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-products", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args()
    if not _qmatmul.qmm_available():
        print("afm_core._mlx.qmm_ext is not available: 'afm q' is MLX's product")
    if not args.skip_products:
        products([int(r) for r in args.rows.split(",")])
    if not args.skip_decode:
        decode(args.tokens, args.rounds)


if __name__ == "__main__":
    main()
