"""One prompt's prefill by its length, with the quantized products going
through sgemm (dequantized tiles) from each ``--gemm-rows`` value on, the
integer kernels below it: where the two paths cross on this CPU and model.

    .venv/bin/python benchmarks/prefill_gemm_rows.py [--model DIR|FILE.gguf] \
        [--lengths 32,64,128,512] [--gemm-rows 32,4096] [--rounds 2]

The model as the engine runs it (afm's CPU rewrite, a float16 KV cache); a
fresh cache per prompt, prompts of distinct tokens per round; the settings
alternate within each round and the best of the rounds is printed (ms and
prompt tokens/s).  ``--gemm-rows 4096``: the integer kernels for every
length listed.  The default threshold is ``qmm_ext.gemm_rows()`` (32 on
AVX2, 64 on AVX-512 VNNI; ``AFM_QMM_GEMM_ROWS``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import afm_core  # noqa: F401  (first: binds MLX's BLAS)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from afm_core._mlx import half_cache
from afm_core._mlx import qmatmul as _qmatmul
from afm_core._mlx.fusion import fuse_for_cpu
from afm_core._models import loader as _loader
from afm_core._models.default_model import ensure_default_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="mlx-lm directory or GGUF (default: the default model)")
    parser.add_argument("--lengths", default="32,64,128,512")
    parser.add_argument("--gemm-rows", default="32,4096")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ext = _qmatmul.extension()
    if ext is None:
        raise SystemExit("afm_core._mlx.qmm_ext is not built")
    path = Path(args.model) if args.model else ensure_default_model()
    if path.suffix == ".gguf":
        from afm_core._models.resolve import resolve_model

        path = resolve_model(str(path))
    model, _, _ = _loader.load(path)
    fuse_for_cpu(model)
    lengths = [int(v) for v in args.lengths.split(",")]
    settings = [int(v) for v in args.gemm_rows.split(",")]
    best: dict[tuple[int, int], float] = {}
    for rnd in range(args.rounds):
        for length in lengths:
            for rows in settings:
                ext.set_gemm_rows(rows)
                cache = half_cache.to_half(make_prompt_cache(model))
                ids = mx.array([[(7 * i + 13 * rnd + rows) % 5000 + 100 for i in range(length)]])
                start = time.perf_counter()
                mx.eval(model(ids, cache=cache))
                took = time.perf_counter() - start
                best[(length, rows)] = min(best.get((length, rows), float("inf")), took)
    ext.set_gemm_rows(-1)
    print(f"model {path.name}, kernels {_qmatmul.kernel_isa()}, default gemm_rows {ext.gemm_rows()}, "
          f"best of {args.rounds} rounds")
    for length in lengths:
        cells = [f"from {rows:>4}: {best[(length, rows)] * 1e3:7.0f} ms {length / best[(length, rows)]:6.1f} tok/s"
                 for rows in settings]
        print(f"  {length:>5} tokens | " + " | ".join(cells))


if __name__ == "__main__":
    main()
