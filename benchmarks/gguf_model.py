"""Tokens/s of a GGUF model converted quantized vs dequantized (and other dtypes).

    .venv/bin/python benchmarks/gguf_model.py                 # the default SmolLM2 Q4_1
    .venv/bin/python benchmarks/gguf_model.py --gguf FILE.gguf --variants q-float32 f-float32 q-float16

A variant is ``q-DTYPE`` (MLX quantized weights, DTYPE scales/activations) or
``f-DTYPE`` (dequantized DTYPE weights).  Each is converted once into a
temporary directory, then timed with mlx-lm's ``stream_generate``: greedy
decoding of ``--tokens`` new tokens after a chat prompt, and a long-prompt
prefill, ``--repeats`` times each; the median is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def bench(model_dir: Path, tokens: int, repeats: int) -> dict[str, float]:
    import afm_core  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

    # isort: split
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    t0 = time.perf_counter()
    model, tok = load(str(model_dir))
    load_s = time.perf_counter() - t0
    chat = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True)
    long_prompt = tok.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 50))
    sampler = make_sampler(temp=0.0)

    def run(p: list[int], n: int) -> tuple[float, float]:
        last = None
        for response in stream_generate(model, tok, p, max_tokens=n, sampler=sampler):
            last = response
        assert last is not None
        return last.prompt_tps, last.generation_tps

    run(prompt, 8)  # warm up
    gen = [run(prompt, tokens)[1] for _ in range(repeats)]
    pre = [run(long_prompt, 1)[0] for _ in range(repeats)]
    mx.clear_cache()
    return {"load_s": load_s, "gen_tps": statistics.median(gen), "prefill_tps": statistics.median(pre),
            "prefill_len": len(long_prompt)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="GGUF file (default: the built-in SmolLM2, fetched if needed)")
    parser.add_argument("--variants", nargs="+", default=["q-float32", "f-float32"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from afm_core._models.gguf.convert import convert_gguf

    if args.gguf:
        gguf = Path(args.gguf)
    else:
        from afm_core._models.default_model import fetch_default_gguf

        gguf = fetch_default_gguf()
    print(f"model: {gguf.name}")
    print(f"{'variant':<12} {'convert s':>9} {'load s':>7} {'size MB':>8} {'gen tok/s':>10} {'prefill tok/s':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            kind, dtype = variant.split("-", 1)
            out = Path(tmp) / variant
            t0 = time.perf_counter()
            convert_gguf(gguf, out, dequantize=kind == "f", dtype=dtype, scale_dtype=dtype)
            conv = time.perf_counter() - t0
            size = sum(p.stat().st_size for p in out.iterdir()) / 1e6
            r = bench(out, args.tokens, args.repeats)
            print(f"{variant:<12} {conv:>9.1f} {r['load_s']:>7.2f} {size:>8.0f} {r['gen_tps']:>10.1f} "
                  f"{r['prefill_tps']:>14.1f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
