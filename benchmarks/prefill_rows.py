"""Several short prompts prefilled together: one by one, as the engine pads them, as one prompt.

    .venv/bin/python benchmarks/prefill_rows.py [--model DIR|FILE.gguf] [--rows 8] [--tokens 60] [--rounds 3]

On the model as the engine runs it (the default model unless ``--model``;
the engine's CPU kernels), each round times, alternating, the engine's
prompt batch (``afm_core._mlx.prefill.EnginePromptBatch``) prefilling
``--rows`` prompts of ``--tokens`` tokens (prompts of different lengths: from
``tokens`` down to 3/4 of it) on empty caches:

* ``alone``: each prompt through the model on its own cache, all evaluated
  together (the engine before padded batches; ``PAD_MAX_TOKENS`` set to 0);
* ``padded``: the engine's way, short chunks as padded batches
  (``padded_groups``);
* ``one``: one prompt of all their tokens, the yardstick (the same tokens,
  no padding, one row).

``alone / one`` is what a burst of short prompts paid for being computed row
by row (the 8-stream phase of ``afm bench --real-model`` sends eight prompts
of about 60 tokens at once); ``padded / one`` what it pays now.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import afm_core  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from afm_core import resolve_model
from afm_core._mlx import prefill
from afm_core._mlx.fusion import fuse_for_cpu
from afm_core._mlx.prefill import EnginePromptBatch
from afm_core._models import loader as _loader


def ids(n: int, seed: int) -> list[int]:
    """``n`` distinct-looking token ids (a fixed pattern per seed)."""
    return [100 + (i * 7919 + seed * 131) % 20000 for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="directory or GGUF file (default: the default model)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model, _, _ = _loader.load(Path(resolve_model(args.model)))
    fuse_for_cpu(model)
    rows = args.rows
    lengths = [args.tokens - (args.tokens // 4) * r // max(rows - 1, 1) for r in range(rows)]
    prompts = [ids(n, r) for r, n in enumerate(lengths)]

    def engine_batch() -> None:
        caches = [make_prompt_cache(model) for _ in range(rows)]
        batch = EnginePromptBatch(model, list(range(rows)), caches, samplers=[None] * rows,
                                  logits_processors=[()] * rows, max_tokens=[1] * rows)
        batch.prompt(prompts)

    def alone() -> None:
        saved = prefill.PAD_MAX_TOKENS
        prefill.PAD_MAX_TOKENS = 0
        try:
            engine_batch()
        finally:
            prefill.PAD_MAX_TOKENS = saved

    def one() -> None:
        cache = make_prompt_cache(model)
        model(mx.array([t for p in prompts for t in p])[None], cache=cache)
        mx.eval([c.state for c in cache])

    runs = {"alone": alone, "padded": engine_batch, "one": one}
    for run in runs.values():  # warm-up
        run()
    print(f"{rows} prompts of {min(lengths)}-{max(lengths)} tokens against one of {sum(lengths)} (seconds)")
    print("| round | alone | padded | one | alone / one | padded / one |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for n in range(args.rounds):
        took = {}
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            took[name] = time.perf_counter() - start
        print(f"| {n + 1} | {took['alone']:.3f} | {took['padded']:.3f} | {took['one']:.3f} "
              f"| {took['alone'] / took['one']:.2f} | {took['padded'] / took['one']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
