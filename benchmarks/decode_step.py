"""Where one single-stream decode step's time goes on MLX's CPU backend.

    .venv/bin/python benchmarks/decode_step.py [--model DIR] [--context 64] [--steps 32] [--no-fusion]

On the model as the engine runs it (the default model, with the engine's CPU
kernels unless ``--no-fusion``), it prints:

* the whole decode step (one token, a KV cache of ``--context`` tokens):
  milliseconds and tokens/s;
* the weight products alone: every linear layer and the output head applied
  to one row, all in one graph, as the step computes them; their bytes over
  that time is the memory bandwidth they reach;
* the rest of the step (norms, rotary embeddings, attention, sampling and
  MLX's per-operation scheduling), by difference;
* the operations in the step's graph, by primitive (``cpu_fusion.census``).

The BLAS under MLX is the one ``afm_core`` binds (``AFM_BLAS=reference`` for
MLX's own).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import afm_core  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from afm_core._mlx.blas import blas_info, confirm
from afm_core._mlx.fusion import fuse_for_cpu
from afm_core._models import loader as _loader
from afm_core._models.default_model import ensure_default_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median_seconds
from cpu_fusion import census


def products(model: Any) -> tuple[Any, int]:
    """A function computing every weight product of one decode step on one
    row, and the bytes of the weights it reads."""
    layers = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    heads = []
    if not any(name.split(".")[-1] == "lm_head" for name, _ in model.named_modules()):
        heads = [m for _, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
    inputs = {}
    for m in layers + heads:
        dims = m.weight.shape[1] * (32 // m.bits if hasattr(m, "bits") else 1)
        if type(m).__name__ == "_TransposedLinear":
            dims = m.weight.shape[0]
        inputs[id(m)] = mx.random.normal((1, 1, dims))
    mx.eval(list(inputs.values()))

    def run() -> None:
        outs = [m(inputs[id(m)]) for m in layers] + [m.as_linear(inputs[id(m)]) for m in heads]
        mx.eval(outs)

    nbytes = sum(sum(v.nbytes for _, v in _params(m)) for m in layers + heads)
    return run, nbytes


def _params(m: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    return tree_flatten(m.parameters())  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="mlx-lm directory (default: the default model)")
    parser.add_argument("--context", type=int, default=64, help="tokens in the KV cache")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--no-fusion", action="store_true", help="mlx-lm's own layers")
    args = parser.parse_args()
    path = Path(args.model) if args.model else ensure_default_model()
    model, tok, _ = _loader.load(path)
    if not args.no_fusion:
        fuse_for_cpu(model)
    confirm()
    print(f"model {path.name}; BLAS {blas_info().describe()}; device {mx.default_device()}")

    cache = make_prompt_cache(model)
    prompt = mx.array([[(7 * i) % 1000 + 10 for i in range(args.context)]])
    mx.eval(model(prompt, cache=cache))
    token = mx.array([[42]])

    def step() -> None:
        nonlocal token
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)

    step_s = median_seconds(step, args.steps)
    run, nbytes = products(model)
    prod_s = median_seconds(run, args.steps)
    print(f"decode step       {step_s * 1e3:8.2f} ms  ({1 / step_s:6.2f} tok/s)")
    print(f"weight products   {prod_s * 1e3:8.2f} ms  ({nbytes / 1e6:.0f} MB read, "
          f"{nbytes / prod_s / 1e9:.1f} GB/s)  {100 * prod_s / step_s:5.1f}%")
    print(f"rest (by diff.)   {(step_s - prod_s) * 1e3:8.2f} ms  {100 * (1 - prod_s / step_s):5.1f}%")
    ops = census(model, tok, 1)
    print(f"operations in one step: {sum(ops.values())}; by primitive: "
          + ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))


if __name__ == "__main__":
    main()
