"""Where a pipelined decode step's time goes on the calling thread, and what
each of a layer's weight products costs alone.

    .venv/bin/python benchmarks/decode_pipeline.py [--model DIR] [--steps 60]

On the model as the engine runs it (afm's CPU kernels, a float16 KV cache of
64 tokens, one row), it prints:

* the step as mlx-lm's batch runs it: the next step's graph built in Python,
  then ``mx.async_eval`` of it, then the wait for the previous step's token.
  ``async_eval`` returns only when the computing thread is about a hundred
  tasks from the end of the step (MLX's ``MAX_ACTIVE_TASKS``), so nearly the
  whole step is spent in it, and building the next graph overlaps only the
  last hundred tasks;
* each product shape of a layer (q/k/v, attention output, gate/up with its
  SwiGLU, MLP down) and the output head: one graph of that product for every
  layer, per product and in GB/s of the weights read.  Compare settings of
  the kernels (``AFM_QMM_THREADS``, ``AFM_QMM_POOL_MIN_WORK``) by running it
  under each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import afm_core  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from afm_core._mlx import activations
from afm_core._mlx.fusion import fuse_for_cpu
from afm_core._mlx.half_cache import to_half
from afm_core._models import loader as _loader
from afm_core._models.default_model import ensure_default_model


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def pipelined(model: Any, steps: int) -> tuple[float, float, float]:
    """Median build, ``async_eval`` and wait per step, in ms."""
    cache = to_half([BatchKVCache([0]) for _ in model.layers])
    mx.eval(model(mx.array([[(7 * i) % 1000 + 10 for i in range(64)]]), cache=cache))
    token = mx.argmax(model(mx.array([[42]]), cache=cache)[:, -1], axis=-1)
    mx.async_eval(token)
    build, call, wait = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        token.item()
        t3 = time.perf_counter()
        token = nxt
        build.append(t1 - t0)
        call.append(t2 - t1)
        wait.append(t3 - t2)
    skip = steps // 6
    return median_ms(build[skip:]), median_ms(call[skip:]), median_ms(wait[skip:])


def weight_bytes(layer: Any) -> int:
    return sum(layer[k].nbytes for k in ("weight", "scales", "biases") if k in layer)


def products(model: Any) -> dict[str, tuple[Callable[[], None], int]]:
    """Each product shape of a layer over every layer, and the head."""
    layers = model.layers
    attn, mlp = layers[0].self_attn, layers[0].mlp
    x = mx.random.normal((1, 1, attn.q_proj.weight.shape[1] * 32 // attn.q_proj.bits))
    wide = mx.random.normal((1, 1, mlp.down_proj.weight.shape[1] * 32 // mlp.down_proj.bits))
    mx.eval(x, wide)
    head = getattr(model, "lm_head", None)
    cases = {
        "q/k/v": (lambda: mx.eval([[a.q_proj(x), a.k_proj(x), a.v_proj(x)] for a in (lay.self_attn for lay in layers)]),
                  sum(weight_bytes(p) for lay in layers for p in (lay.self_attn.q_proj, lay.self_attn.k_proj,
                                                                  lay.self_attn.v_proj))),
        "attention out": (lambda: mx.eval([lay.self_attn.o_proj(x) for lay in layers]),
                          sum(weight_bytes(lay.self_attn.o_proj) for lay in layers)),
        "gate/up + SwiGLU": (lambda: mx.eval([activations.swiglu(lay.mlp.gate_proj(x), lay.mlp.up_proj(x))
                                              for lay in layers]),
                             sum(weight_bytes(lay.mlp.gate_proj) + weight_bytes(lay.mlp.up_proj) for lay in layers)),
        "MLP down": (lambda: mx.eval([lay.mlp.down_proj(wide) for lay in layers]),
                     sum(weight_bytes(lay.mlp.down_proj) for lay in layers)),
    }
    if head is not None:
        cases["output head"] = (lambda: mx.eval(head(x)), weight_bytes(head))
    else:
        embed = model.model.embed_tokens
        cases["output head"] = (lambda: mx.eval(embed.as_linear(x)), weight_bytes(embed))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="mlx-lm directory (default: the default model)")
    parser.add_argument("--steps", type=int, default=60, help="steps (and product repeats) timed")
    args = parser.parse_args()
    path = Path(args.model) if args.model else ensure_default_model()
    model, _, _ = _loader.load(path)
    fuse_for_cpu(model)
    build, call, wait = pipelined(model, args.steps)
    print(f"model {path.name}")
    print(f"pipelined step: build {build:.2f} ms, async_eval {call:.2f} ms, wait {wait:.2f} ms, "
          f"sum {build + call + wait:.2f} ms")
    layers = len(model.layers)
    for name, (run, nbytes) in products(model).items():
        for _ in range(3):
            run()
        samples = []
        for _ in range(args.steps):
            t = time.perf_counter()
            run()
            samples.append(time.perf_counter() - t)
        s = statistics.median(samples)
        calls = 1 if name == "output head" else layers
        print(f"{name:17s} {s * 1e3:7.3f} ms for {calls:3d}: {s / calls * 1e6:7.1f} us each, "
              f"{nbytes / 1e6:6.1f} MB, {nbytes / s / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
