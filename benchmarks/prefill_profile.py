"""Where a long prompt's prefill goes: one chunk of a transformer layer, operation by operation.

    .venv/bin/python benchmarks/prefill_profile.py [--model default|random|DIR] [--context 4096]
        [--chunk 2048] [--repeats 3] [--sweep 256,512,1024,2048] [--threads 1,2]

The model runs as the engine runs it (``fuse_for_cpu``: afm's quantized
products, norms, decode attention, and the prefill attention kernel).  Its
cache is first filled to ``context - chunk`` tokens; then the last chunk's
first layer is taken apart (a llama- or qwen2-style layer: ``self_attn`` with
``q_proj`` .. ``o_proj`` and ``rope``, ``mlp`` with ``gate_proj`` ..
``down_proj``) and each operation is timed alone on the real activations
(evaluated one at a time: each operation's own time, MLX's per-operation
overhead included), the median of ``--repeats``.  Printed per operation: ms
for one layer, the share of the sum, and GFLOP/s for the products and the
attention (multiply-adds x 2 / time); then the whole layer and the whole
chunk timed as the model runs them, and MLX's own attention graph
(``AFM_NO_PREFILL_ATTENTION``) for comparison.

``--sweep`` prefills a whole ``--context`` prompt at each chunk size (tokens/s,
wall and CPU time: the CPU time says what it costs on a machine other jobs
share too); ``--threads`` does the same at each limit of the kernels' thread
pool (``qmm_ext.set_thread_limit``; OpenBLAS keeps its own threads,
``AFM_BLAS_THREADS``).  The machine is shared: compare numbers from one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import model_path  # (first: imports afm_core before mlx)

# isort: split
import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from afm_core._mlx import attention as _attention
from afm_core._mlx import qmatmul as _qmatmul
from afm_core._mlx.fusion import fuse_for_cpu


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """The median seconds of ``mx.eval(fn())`` after one warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prompt(n: int) -> list[int]:
    return [(i * 7919) % 30000 + 100 for i in range(n)]


def filled_cache(model: Any, n: int, chunk: int) -> list[Any]:
    cache = make_prompt_cache(model)
    ids = prompt(n)
    for s in range(0, n, chunk):
        model(mx.array(ids[s:s + chunk])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def layer_ops(model: Any, cache: list[Any], chunk: int, repeats: int) -> list[tuple[str, float, float]]:
    """(operation, seconds, multiply-adds) for layer 0 on the chunk after ``cache``."""
    inner = model.model
    layer, c = inner.layers[0], cache[0]
    attn, mlp = layer.self_attn, layer.mlp
    ids = mx.array(prompt(c.offset + chunk)[c.offset:])[None]
    h = inner.embed_tokens(ids)
    mx.eval(h)
    B, L, _ = h.shape
    nh, nkv = attn.n_heads, attn.n_kv_heads
    ops: list[tuple[str, float, float]] = []

    def add(name: str, fn: Callable[[], Any], macs: float = 0.0) -> Any:
        ops.append((name, timed(fn, repeats), macs))
        out = fn()
        mx.eval(out)
        return out

    def proj_macs(p: Any) -> float:
        rows, words = p.weight.shape
        return float(L * rows * words * 32 / getattr(p, "bits", 32))

    x = add("input norm", lambda: layer.input_layernorm(h))
    # (q, k, v and gate, up may be one product each: afm_core._mlx.qmm_groups)
    q, k, v = add("q_proj + k_proj + v_proj", lambda: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)),
                  sum(proj_macs(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj)))
    qh = add("q/k/v to heads (copies)", lambda: mx.contiguous(q.reshape(B, L, nh, -1).transpose(0, 2, 1, 3)))
    kh = mx.contiguous(k.reshape(B, L, nkv, -1).transpose(0, 2, 1, 3))
    vh = mx.contiguous(v.reshape(B, L, nkv, -1).transpose(0, 2, 1, 3))
    mx.eval(kh, vh)
    qr = add("rope q", lambda: attn.rope(qh, offset=c.offset), 0)
    kr = add("rope k", lambda: attn.rope(kh, offset=c.offset), 0)
    # the cache's update: a copy into its buffer (timed on a throwaway copy of the cache)
    keys = mx.concatenate([c.keys[..., :c.offset, :], kr], axis=2)
    values = mx.concatenate([c.values[..., :c.offset, :], vh], axis=2)
    add("KV cache write", lambda: mx.concatenate([c.keys[..., :c.offset, :], kr], axis=2))
    S, D = keys.shape[2], keys.shape[3]
    att_macs = float(B * nh * L * (S - L / 2) * D * 2)
    o = add("attention (prefill kernel)", lambda: _attention.scaled_dot_product_attention(
        qr, keys, values, cache=None, scale=attn.scale, mask="causal"), att_macs)
    flat = add("heads back (copy)", lambda: o.transpose(0, 2, 1, 3).reshape(B, L, -1))
    a = add("o_proj", lambda: attn.o_proj(flat), proj_macs(attn.o_proj))
    h2 = add("residual add", lambda: h + a)
    y = add("post-attention norm", lambda: layer.post_attention_layernorm(h2))
    g, u = add("gate_proj + up_proj", lambda: (mlp.gate_proj(y), mlp.up_proj(y)),
               proj_macs(mlp.gate_proj) + proj_macs(mlp.up_proj))
    from mlx_lm.models.activations import swiglu

    act = add("swiglu", lambda: swiglu(g, u))
    d = add("down_proj", lambda: mlp.down_proj(act), proj_macs(mlp.down_proj))
    add("residual add", lambda: h2 + d)
    os.environ[_attention.NO_PREFILL_ATTENTION_ENV] = "1"
    try:
        mlx_att = timed(lambda: _attention.scaled_dot_product_attention(
            qr, keys, values, cache=None, scale=attn.scale, mask="causal"), 1)
    finally:
        del os.environ[_attention.NO_PREFILL_ATTENTION_ENV]
    ops.append(("(MLX's attention graph, for comparison)", mlx_att, att_macs))
    return ops


def whole(model: Any, context: int, chunk: int, repeats: int) -> tuple[float, float]:
    """Seconds for one layer and for the whole model on the chunk after ``context - chunk`` tokens."""
    cache = filled_cache(model, context - chunk, chunk)
    ids = mx.array(prompt(context)[context - chunk:])[None]
    inner = model.model
    layer, c = inner.layers[0], cache[0]
    h = inner.embed_tokens(ids)
    mask = "causal"
    mx.eval(h)
    offset = c.offset

    def one_layer() -> Any:
        c.offset = offset  # (writes the same positions again each time)
        return layer(h, mask, c)

    t_layer = timed(one_layer, repeats)
    times = []
    for _ in range(repeats):
        for x in cache:
            x.offset = offset
        t0 = time.perf_counter()
        model(ids, cache=cache)
        mx.eval([x.state for x in cache])
        times.append(time.perf_counter() - t0)
    return t_layer, statistics.median(times)


def prefill_rate(model: Any, context: int, chunk: int) -> tuple[float, float]:
    """(tokens/s wall, tokens per CPU-second) prefilling ``context`` tokens ``chunk`` at a time."""
    cache = make_prompt_cache(model)
    ids = prompt(context)
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, context, chunk):
        model(mx.array(ids[s:s + chunk])[None], cache=cache)
        mx.eval([x.state for x in cache])
        mx.clear_cache()  # as the engine's prefill does between chunks
    return context / (time.perf_counter() - t0), context / (time.process_time() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep", default="", help="chunk sizes to prefill the whole context with")
    ap.add_argument("--threads", default="", help="thread limits of the kernels' pool to compare")
    args = ap.parse_args()
    path = model_path(args.model, Path(tempfile.mkdtemp()))
    model, _ = mlx_lm.load(str(path))
    fuse_for_cpu(model)
    ext = _qmatmul.extension()
    n_layers = len(model.model.layers)
    print(f"model: {path} ({n_layers} layers)  device: {mx.default_device()}  "
          f"kernels: {ext.isa() if ext else 'none'}  attention path: "
          f"{ext.prefill_attention_path(64) if ext else 'mlx'}  gemm rows: {ext.gemm_rows() if ext else '-'}")
    print(f"chunk of {args.chunk} tokens after {args.context - args.chunk} (context {args.context}), "
          f"median of {args.repeats}\n")
    cache = filled_cache(model, args.context - args.chunk, args.chunk)
    ops = layer_ops(model, cache, args.chunk, args.repeats)
    total = sum(t for name, t, _ in ops if not name.startswith("("))
    print(f"{'operation (layer 0)':<40} {'ms':>8} {'share':>6} {'GFLOP/s':>8}")
    for name, t, macs in ops:
        share = "" if name.startswith("(") else f"{100 * t / total:5.1f}%"
        rate = f"{2 * macs / t / 1e9:8.1f}" if macs else ""
        print(f"{name:<40} {1000 * t:8.2f} {share:>6} {rate:>8}")
    t_layer, t_model = whole(model, args.context, args.chunk, args.repeats)
    print(f"\n{'sum of the operations':<40} {1000 * total:8.2f}")
    print(f"{'the layer as the model runs it':<40} {1000 * t_layer:8.2f}")
    print(f"{'the whole model, this chunk':<40} {1000 * t_model:8.2f}   "
          f"({n_layers} layers: {1000 * t_layer * n_layers:.0f} ms of layers; "
          f"{args.chunk / t_model:.1f} tok/s)")
    if args.sweep:
        print(f"\nprefill of {args.context} tokens by chunk size:")
        for chunk in [int(x) for x in args.sweep.split(",")]:
            wall, cpu = prefill_rate(model, args.context, chunk)
            print(f"  chunk {chunk:>5}: {wall:7.1f} tok/s  {cpu:7.1f} tok per CPU-s")
    if args.threads and ext is not None:
        print(f"\nprefill of {args.context} tokens, chunks of {args.chunk}, by kernel threads:")
        for n in [int(x) for x in args.threads.split(",")]:
            ext.set_thread_limit(n)
            wall, cpu = prefill_rate(model, args.context, args.chunk)
            print(f"  {n} thread(s): {wall:7.1f} tok/s  {cpu:7.1f} tok per CPU-s")
        ext.set_thread_limit(0)


if __name__ == "__main__":
    main()
