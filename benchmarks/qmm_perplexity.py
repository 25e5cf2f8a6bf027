"""Perplexity of a real model through afm's quantized kernels vs MLX's own product.

    .venv/bin/python benchmarks/qmm_perplexity.py \\
        [--gguf ~/.cache/afm/downloads/real/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf ...] [--tokens 2048]
        [--isa default,avx2] [--act-bits 16,8] [--bits 4]

The model is the GGUF as ``decode_llamacpp.py`` builds it (``_gguf_mlx``: 4-bit
MLX layout, group 32, float16 scales).  The text is Python's own
``textwrap.py`` and ``json/decoder.py`` (code, for a coder model; the
same for a given Python), tokenized by llama.cpp; it is scored in windows of
``--window`` tokens.  Variants: ``mlx`` (mlx-lm's layers: ``mx.quantized_matmul``,
float arithmetic on the dequantized weights: the reference), then afm's
kernels per kernel set and activation precision, every product of every
window on the integer kernels (``set_gemm_rows(0)``: as decoding computes
them; prefill's float sgemm path would hide them).  Prints each perplexity and
its difference from the reference.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from _gguf_mlx import build
from _llamacpp_peer import llama_server

from afm_core._mlx import qmatmul as _qmatmul
from afm_core.testing._real_gguf import real_gguf_path

GGUFS = [str(real_gguf_path("qwen2.5-coder-0.5b")), str(real_gguf_path("qwen2.5-coder-1.5b"))]
"""The real GGUFs where ``afm testing fetch-real NAME`` keeps them."""


def text() -> str:
    return inspect.getsource(textwrap) + inspect.getsource(json.decoder)


def perplexity(model: nn.Module, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        logits = model(mx.array([chunk[:-1]]))[0].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        target = mx.array(chunk[1:])
        nll -= mx.take_along_axis(logp, target[:, None], axis=-1).sum().item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def run(gguf: Path, args: argparse.Namespace) -> None:
    from mlx_lm.utils import load_model

    from afm_core._mlx.fusion import fuse_for_cpu, unfuse_cpu_kernels

    ext = _qmatmul.extension()
    if ext is None:
        raise SystemExit("afm_core._mlx.qmm_ext is not built")
    with llama_server(gguf, 1, parallel=1, ctx=512) as peer:
        ids = peer.tokenize(text())[: args.tokens]
    path = build(gguf, bits=args.bits, group=args.group, scales=args.scales)
    model, _ = load_model(path)
    print(f"\n{gguf.name} as {path.name}: {len(ids)} tokens, windows of {args.window}")
    ref = perplexity(model, ids, args.window)
    print(f"  {'mlx (mx.quantized_matmul)':<28} {ref:9.4f}")
    fuse_for_cpu(model)
    ext.set_gemm_rows(0)
    best = ext.available_isas()[-1]
    try:
        for isa in args.isa.split(","):
            name = best if isa == "default" else isa
            if name not in ext.available_isas():
                continue
            ext.set_isa(name)
            for bits in (int(b) for b in args.act_bits.split(",")):
                ext.set_activation_bits(bits)
                p = perplexity(model, ids, args.window)
                print(f"  {f'afm {name} a{bits}':<28} {p:9.4f}  {100 * (p / ref - 1):+7.3f}%", flush=True)
    finally:
        ext.set_gemm_rows(-1)
        ext.set_activation_bits(16)
        ext.set_isa(best)
        unfuse_cpu_kernels(model)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", action="append")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--isa", default="default,avx2")
    ap.add_argument("--act-bits", default="16,8")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--scales", default="float16")
    args = ap.parse_args()
    for g in args.gguf or GGUFS:
        run(Path(g), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
