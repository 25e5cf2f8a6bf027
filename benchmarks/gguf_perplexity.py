"""Perplexity of real GGUF models: afm against llama.cpp on the same file,
and the cost of each conversion layout against the exact float weights.

Usage::

    .venv/bin/python benchmarks/gguf_perplexity.py [--models qwen2.5-coder-0.5b,...]
        [--tokens 1024] [--served] [--llamacpp] [--layouts] [--gguf-dir DIR]

* The text is ``afm_core/testing/corpus.txt`` (prose and code), tokenized
  once (by llama.cpp when it is installed, else by the converted model's
  tokenizer) and cut at ``--tokens``; every measurement scores the same
  token ids, so the numbers compare the models, not the tokenizers.
* ``--served`` starts ``afm serve --model FILE.gguf`` (a fresh ``AFM_HOME``,
  so it converts) and scores the ids with ``/v1/completions`` (``echo``,
  ``logprobs: 0``, ``max_tokens: 0``): the product's own path.
* ``--llamacpp`` scores them with ``llama-cpp-python`` (``logits_all``,
  2 threads): the reference.
* ``--layouts`` converts the file several ways and scores each with a plain
  forward pass: ``dense`` (``--dequantize``: llama.cpp's dequantized values
  in float32, the exact reference), ``default`` (float16 scales, Q6_K on 8
  bits), ``f32-scales``, ``q6k-6bit``; with each directory's size and
  conversion time, and how far each moves the tokens' log-probabilities
  from ``dense`` (root mean square: more sensitive than perplexity).

Perplexity is ``exp`` of the mean negative log-likelihood of tokens 2..n
(each given all before it).  The real models come from
:func:`afm_core.testing.fetch_real_gguf` unless ``--gguf-dir`` holds them.
Timings (conversion) are on whatever machine runs this; say how loaded it was.
"""

from __future__ import annotations

import _common  # noqa: F401  (afm_core before mlx: OpenBLAS)

# isort: split
import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from afm_core.testing._perplexity import (
    CORPUS,
    llamacpp_logprobs,
    llamacpp_token_ids,
    perplexity,
    served_logprobs,
)


def gguf_file(name: str, gguf_dir: str | None) -> Path:
    from afm_core.testing import REAL_GGUFS, fetch_real_gguf

    if gguf_dir:
        p = Path(gguf_dir) / REAL_GGUFS[name].file
        if p.is_file():
            return p
    return fetch_real_gguf(name)


def token_ids(path: Path, n: int, model_dir: Path) -> list[int]:
    try:
        return llamacpp_token_ids(path, n)
    except ImportError:  # no llama.cpp: the converted model's own tokenizer
        from transformers import AutoTokenizer

        text = CORPUS.read_text(encoding="utf-8")
        return list(AutoTokenizer.from_pretrained(str(model_dir)).encode(text))[:n]


def score_raw(model_dir: Path, ids: list[int]) -> list[float]:
    """The converted model's log-probabilities, one forward pass (afm's CPU kernels)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from afm_core._mlx.fusion import fuse_for_cpu

    model, _ = load_model(model_dir)
    fuse_for_cpu(model)
    logits = model(mx.array([ids[:-1]]))[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(lp, mx.array(ids[1:])[:, None], axis=-1)[:, 0]
    return [float(x) for x in np.array(picked)]


# --- layouts ------------------------------------------------------------------------

LAYOUTS: dict[str, dict[str, Any]] = {
    "dense": {"dequantize": True},
    "default": {},
    "f32-scales": {"scale_dtype": "float32"},
    "q6k-6bit": {"q6k_bits": 6},
}


def convert_timed(path: Path, out: Path, **kw: Any) -> tuple[float, int]:
    from afm_core._models.gguf.convert import convert_gguf

    t0 = time.monotonic()
    convert_gguf(path, out, overwrite=True, **kw)
    seconds = time.monotonic() - t0
    size = sum(p.stat().st_size for p in out.iterdir())
    return seconds, size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b,gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--served", action="store_true")
    ap.add_argument("--llamacpp", action="store_true")
    ap.add_argument("--layouts", default="", help=f"comma-separated, of {','.join(LAYOUTS)}")
    ap.add_argument("--gguf-dir", default=None)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    for name in args.models.split(","):
        path = gguf_file(name, args.gguf_dir)
        with tempfile.TemporaryDirectory(prefix="afm-ppl-") as tmp:
            work = Path(tmp)
            base_dir = work / "default"
            base_secs, base_size = secs, size = convert_timed(path, base_dir)
            ids = token_ids(path, args.tokens, base_dir)
            row: dict[str, Any] = {"model": name, "tokens": len(ids), "gguf_bytes": path.stat().st_size,
                                   "convert_s": round(secs, 1), "converted_bytes": size}
            print(f"{name}: {len(ids)} tokens; converted in {secs:.1f} s to {size / 1e6:.0f} MB",
                  flush=True)
            if args.llamacpp:
                row["llamacpp"] = perplexity(llamacpp_logprobs(path, ids))
                print(f"  llama.cpp           ppl {row['llamacpp']:.4f}", flush=True)
            if args.served:
                home = work / "home"
                lps, ready = served_logprobs(path, ids, home=home)
                row["afm_served"], row["serve_ready_s"] = perplexity(lps), round(ready, 1)
                print(f"  afm serve           ppl {row['afm_served']:.4f} (ready in {ready:.0f} s)", flush=True)
            dense_lp: np.ndarray | None = None
            for layout in filter(None, args.layouts.split(",")):
                out = base_dir if layout == "default" else work / layout
                secs, size = (base_secs, base_size) if layout == "default" else \
                    convert_timed(path, out, **LAYOUTS[layout])
                lp = np.array(score_raw(out, ids))
                row[f"layout:{layout}"] = r = {"ppl": perplexity(lp), "bytes": size, "convert_s": round(secs, 1)}
                if layout == "dense":
                    dense_lp = lp
                elif dense_lp is not None:  # per-token log-probability moved by the layout
                    r["dlogp_rms"] = float(np.sqrt(np.mean((lp - dense_lp) ** 2)))
                extra = f"  rms dlogp vs dense {r['dlogp_rms']:.4f}" if "dlogp_rms" in r else ""
                print(f"  layout {layout:12s} ppl {r['ppl']:.4f}  {size / 1e6:7.0f} MB  "
                      f"converted in {secs:.1f} s{extra}", flush=True)
                if layout != "default":
                    shutil.rmtree(out, ignore_errors=True)
            results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
