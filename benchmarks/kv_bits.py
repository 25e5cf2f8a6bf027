"""KV cache formats on one model: float32, float16 (``--kv-dtype``) and quantized (``--kv-bits``).

For ``float32`` (``kv_dtype="model"`` on afm's float32 CPU models),
``float16`` (``kv_dtype="float16"``, the default's choice there), ``8`` and
``4`` bits (``EngineConfig.kv_bits``, group size 64) this reports:

* **KV bytes per token**: the model's own cache arrays after prefilling
  ``--memory-tokens`` tokens (a multiple of the caches' 256-position step, so
  no unused capacity is counted), ``nbytes`` summed over every layer's keys
  and values (with 8 or 4 bits: data, scales and biases), divided by the
  tokens.  Deterministic: measured once.
* **single-stream decode tok/s** at each ``--contexts`` prompt length:
  one greedy completion of ``--decode-tokens`` tokens through an engine
  (``decode_tok_s`` of its ``X-AFM-Profile``: (tokens - 1) / time from the
  first token to the last), no prefix cache.  The three engines are open
  together and take turns, request by request, over ``--rounds`` rounds; the
  range over rounds is printed (the machine may be shared: compare within a
  run only).
* with ``--mlx-lm-attention``, also each quantized setting's decode rate
  through mlx-lm's ``quantized_scaled_dot_product_attention`` (rows
  ``8-bit mlx-lm``): the same engine, the fused kernel
  (``qmm_ext.quantized_decode_attention``) switched off for those requests
  only, so before and after take turns in one run.
* **greedy agreement with float32 KV** over 8 fixed chat prompts x
  ``--agree-tokens`` tokens, all in flight together (a batch): the fraction
  of tokens identical up to each prompt's first divergence from the float32
  engine's tokens, and how many prompts match in full.
* **perplexity** of the first ``--ppl-tokens`` tokens of the fixed corpus
  ``afm_core/testing/corpus.txt`` (the prompt's own log-probabilities, ``echo`` scoring, computed
  over that format's cache as it is prefilled).

    .venv/bin/python benchmarks/kv_bits.py [--model default|random|DIR] [--rounds 3]
        [--contexts 512,2048] [--decode-tokens 64] [--agree-tokens 64] [--ppl-tokens 1024]
        [--mlx-lm-attention]
"""

from __future__ import annotations

import _common  # (first: imports afm_core before mlx)

# isort: split
import argparse
import contextlib
import statistics
import tempfile
from pathlib import Path
from typing import Any

import trio

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about a lighthouse.",
    "What is the capital of Australia, and why is it not Sydney?",
    "List three uses of a paperclip.",
    "Describe how a bicycle works to a child.",
    "Give me a recipe for pancakes.",
    "What are the planets of the solar system?",
    "Summarize the plot of Romeo and Juliet.",
]
SETTINGS: tuple[int | str, ...] = ("float32", "float16", 8, 4)
"""The formats: a float type (``kv_dtype``) or bits (``kv_bits``)."""
REFERENCE = "float32"


def engine_options(setting: int | str) -> dict[str, Any]:
    if isinstance(setting, str):
        return {"kv_dtype": "model" if setting == "float32" else setting}
    return {"kv_bits": setting}


Variant = tuple[int | str, bool]
"""A decode-rate row: the format and whether mlx-lm's quantized attention replaces the kernel."""


def label(setting: int | str, mlx_lm: bool = False) -> str:
    return (setting if isinstance(setting, str) else f"{setting}-bit") + (" mlx-lm" if mlx_lm else "")


@contextlib.contextmanager
def mlx_lm_attention(on: bool) -> Any:
    """While ``on``: afm's attention wrapper leaves quantized caches to mlx-lm."""
    from afm_core._mlx import attention

    real = attention._applies_quantized
    if on:
        attention._applies_quantized = lambda *a: False  # type: ignore[assignment]
    try:
        yield
    finally:
        attention._applies_quantized = real  # type: ignore[assignment]


def kv_bytes_per_token(path: Path, tokens: int) -> dict[int | str, float]:
    """Each setting's cache bytes per token, from the arrays themselves."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    from afm_core._mlx.half_cache import to_half
    from afm_core._mlx.quantized_cache import make_quantized_cache

    model, _ = mlx_lm.load(str(path))
    ids = mx.array([[(i * 7919) % 1000 + 10 for i in range(tokens)]])
    out: dict[int | str, float] = {}
    for bits in SETTINGS:
        if isinstance(bits, str):
            cache = make_prompt_cache(model)
            if bits == "float16":
                to_half(cache)
        else:
            cache = make_quantized_cache(model, bits=bits, group_size=64)
        model(ids, cache=cache)
        arrays = [x for _, x in tree_flatten([(c.keys, c.values) for c in cache])]
        mx.eval(arrays)
        if any(x.shape[2] != tokens for x in arrays):
            raise SystemExit(f"--memory-tokens must be a multiple of 256 (a cache holds {arrays[0].shape[2]})")
        out[bits] = sum(x.nbytes for x in arrays) / tokens
    return out


async def decode_rate(engine: Any, ids: list[int], n: int) -> float:
    from afm_core import CompletionRequest, Profile

    req = CompletionRequest.from_openai({"temperature": 0, "ignore_eos": True, "max_tokens": n}, tuple(ids))
    async with engine.stream(req, profile="basic") as s:
        events = [e async for e in s]
    profile = next(e for e in events if isinstance(e, Profile)).payload
    return float(profile["decode_tok_s"])


CORPUS = Path(__file__).resolve().parent.parent / "afm_core" / "testing" / "corpus.txt"
"""A fixed text (the GGUF perplexity benchmark's), so reruns score the same tokens."""


async def perplexity(engine: Any, text: str, n: int) -> float:
    """exp(-mean log-probability) of the first ``n`` tokens of ``text``, as the engine scores them."""
    import math

    from afm_core import CompletionRequest

    ids = engine._tokenizer.encode(text)[:n]
    req = CompletionRequest.from_openai({"max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0},
                                        tuple(ids))
    async with engine.stream(req) as s:
        async for _ in s:
            pass
        scored = s.prompt_logprobs
    lps = [x for x in scored.logprobs if x is not None]
    return math.exp(-sum(lps) / len(lps))


async def greedy_batch(engine: Any, n: int) -> list[list[int]]:
    from afm_core import CompletionRequest, LogprobsDelta

    tok = engine._tokenizer
    out: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i]}], add_generation_prompt=True)
        req = CompletionRequest.from_openai({"temperature": 0, "ignore_eos": True, "max_tokens": n,
                                             "logprobs": 0}, tuple(ids))
        async with engine.stream(req) as s:
            out[i] = [t.bytes for e in [e async for e in s] if isinstance(e, LogprobsDelta) for t in e.content]

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    return out


def agreement(ref: list[list[Any]], got: list[list[Any]]) -> tuple[float, int]:
    same = 0
    full = 0
    for a, b in zip(ref, got, strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        same += k
        full += a == b
    return same / sum(len(a) for a in ref), full


async def main(args: argparse.Namespace) -> None:
    from afm_core import open_engine

    path = _common.model_path(args.model, Path(tempfile.mkdtemp()))
    contexts = [int(x) for x in args.contexts.split(",")]
    print(f"model {path}")
    per_token = kv_bytes_per_token(path, args.memory_tokens)
    variants: list[Variant] = [(b, False) for b in SETTINGS]
    if args.mlx_lm_attention:
        variants += [(b, True) for b in SETTINGS if not isinstance(b, str)]
    rates: dict[tuple[Variant, int], list[float]] = {(v, c): [] for v in variants for c in contexts}
    async with contextlib.AsyncExitStack() as stack:
        engines = {b: await stack.enter_async_context(open_engine(path, prefix_cache_bytes=0, max_batch=8,
                                                                  **engine_options(b)))
                   for b in SETTINGS}
        tokens = {b: await greedy_batch(engines[b], args.agree_tokens) for b in SETTINGS}
        text = await trio.to_thread.run_sync(CORPUS.read_text)
        ppl = {b: await perplexity(engines[b], text, args.ppl_tokens) for b in SETTINGS}
        for r in range(args.rounds):
            for ctx in contexts:
                ids = [(i * 104729 + r) % 20000 + 100 for i in range(ctx)]
                for v in variants:
                    with mlx_lm_attention(v[1]):
                        rates[(v, ctx)].append(await decode_rate(engines[v[0]], ids, args.decode_tokens))
            print(f"round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{label(*v)} @{c} {xs[-1]:.1f}" for (v, c), xs in rates.items()), flush=True)

    head = ["KV", "bytes/token", f"vs {REFERENCE}"]
    head += [f"decode tok/s @{c} (median, range)" for c in contexts]
    head += [f"agreement ({len(PROMPTS)}x{args.agree_tokens})", "full matches",
             f"perplexity ({args.ppl_tokens} tokens)"]
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for v in variants:
        b = v[0]
        row = [label(*v), f"{per_token[b]:,.0f}", f"{per_token[b] / per_token[REFERENCE]:.3f}"]
        for c in contexts:
            xs = rates[(v, c)]
            row.append(f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})")
        frac, full = agreement(tokens[REFERENCE], tokens[b])
        row += [f"{frac:.3f}", f"{full}/{len(PROMPTS)}", f"{ppl[b]:.4f}"] if not v[1] else ["", "", ""]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="default, random or a model directory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--contexts", default="512,2048", help="prompt lengths for the decode rate")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--agree-tokens", type=int, default=64)
    p.add_argument("--memory-tokens", type=int, default=512)
    p.add_argument("--ppl-tokens", type=int, default=1024, help="corpus tokens scored for the perplexity")
    p.add_argument("--mlx-lm-attention", action="store_true",
                   help="also time the quantized settings through mlx-lm's attention (the unfused path)")
    trio.run(main, p.parse_args())
