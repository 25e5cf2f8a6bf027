"""Speculative decoding in the engine: acceptance rate and tok/s vs none.

    .venv/bin/python benchmarks/speculative.py [--model default|random|DIR] [--levels 1,2,4,8]
        [--rounds 3] [--max-tokens 200] [--lookup 4] [--draft-layers 6] [--draft DIR] [--draft-tokens 3]
        [--temperature 0]

Engines on the same model, all open at once and taking turns (interleaved
rounds, so the machine's noise hits each alike): ``off`` (no speculation),
``lookup`` (``prompt_lookup=--lookup``) and, with ``--draft`` or
``--draft-layers``, ``draft`` (``draft_model``, ``draft_tokens``).  Each
speculating engine has ``spec_max_batch`` at the widest level, so every
level measures speculation itself (the threshold is chosen from that).

Two workloads, greedy unless ``--temperature`` (then sampled: speculative
sampling; the texts differ from ``off``'s by design, so "same text" is "-"): ``rewrite`` (a code snippet to repeat with one
change: the output repeats the prompt, what prompt lookup is for) and
``chat`` (a short essay: little to look up).  At each level C, C requests
of the workload run concurrently; reported per engine: aggregate decode
tok/s (from the first token to the last, prefill left out; median over
rounds), the ratio to ``off`` (median of the paired
ratios), the acceptance rate (accepted / proposed tokens, from
``Engine.statistics()``), tokens proposed per verify step, and whether the
text equals ``off``'s.

``--draft-layers N`` makes a draft offline from the model itself: its first
N layers, the same embeddings, final norm and head (written under a
temporary directory); a real smaller model of the same tokenizer can be
given with ``--draft``.
"""

from __future__ import annotations

import _common  # first: binds the BLAS (see there)

# isort: split
import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import afm_core
from afm_core.bench._spec_prompts import CHAT, CODE_EDIT, code_edit_prompt

WORKLOADS = {  # the texts of `afm bench --speculation` (one of each)
    "rewrite": code_edit_prompt(*CODE_EDIT[0]),
    "chat": CHAT[0],
}


def make_layer_draft(model: Path, layers: int, out: Path) -> Path:
    """``model`` cut to its first ``layers`` layers (a self-draft)."""
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    weights: dict[str, Any] = {}
    for f in sorted(model.glob("*.safetensors")):
        weights.update(mx.load(str(f)))  # type: ignore[arg-type]
    keep = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    mx.save_safetensors(str(out / "model.safetensors"), keep, metadata={"format": "mlx"})
    return out


async def run_level(engine: afm_core.Engine, prompt: str, c: int, max_tokens: int,
                    temperature: float = 0.0) -> tuple[float, int, list[str]]:
    """C concurrent greedy requests: (decode seconds, decode tokens, texts).
    Decode time runs from the first request's first token to the last
    request's end, and its tokens leave out each request's first one, so the
    prompt's prefill (long for ``rewrite``, and cached after the first round)
    is not counted."""
    from afm_core import ContentDelta, Usage

    texts = [""] * c
    tokens = [0]
    firsts: list[float] = []

    async def one(i: int) -> None:
        request = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                   "temperature": temperature}
        parts = []
        async with engine.stream(request) as s:
            async for e in s:
                if isinstance(e, ContentDelta):
                    if not parts:
                        firsts.append(time.perf_counter())
                    parts.append(e.text)
                elif isinstance(e, Usage):
                    tokens[0] += e.completion_tokens - 1
        texts[i] = "".join(parts)

    async with trio.open_nursery() as nursery:
        for i in range(c):
            nursery.start_soon(one, i)
    return time.perf_counter() - min(firsts), tokens[0], texts


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="afm-spec-"))
    model = _common.model_path(args.model, work) if args.model != "default" else \
        Path(afm_core.resolve_model(None))
    levels = [int(x) for x in args.levels.split(",")]
    widest = max(levels)
    configs: dict[str, dict[str, Any]] = {
        "off": {"spec_max_batch": 0},
        "lookup": {"prompt_lookup": args.lookup, "spec_max_batch": widest},
    }
    draft = Path(args.draft) if args.draft else None
    if draft is None and args.draft_layers:
        draft = make_layer_draft(model, args.draft_layers, work / "draft")
    if draft is not None:
        configs["draft"] = {"draft_model": str(draft), "draft_tokens": args.draft_tokens, "spec_max_batch": widest}
    print(f"model {model}; draft {draft or '-'}; levels {levels}; {args.rounds} interleaved rounds; "
          f"{args.max_tokens} tokens per request, temperature {args.temperature}")
    rates: dict[tuple[str, str, int], list[float]] = {}
    ratios: dict[tuple[str, str, int], list[float]] = {}
    counts: dict[tuple[str, str, int], list[int]] = {}
    same: dict[tuple[str, str, int], bool] = {}
    async with trio.open_nursery() as nursery:
        engines = {}
        for name, kw in configs.items():
            engines[name] = await nursery.start(afm_core.Engine(model, max_batch=widest, **kw).run)
        for _ in range(args.rounds):
            for wl, prompt in WORKLOADS.items():
                for c in levels:
                    base_rate = 0.0
                    base_texts: list[str] = []
                    for name, engine in engines.items():
                        s0 = engine.statistics()
                        dt, toks, texts = await run_level(engine, prompt, c, args.max_tokens, args.temperature)
                        s1 = engine.statistics()
                        key = (wl, name, c)
                        rate = toks / dt
                        rates.setdefault(key, []).append(rate)
                        got = counts.setdefault(key, [0, 0, 0])
                        got[0] += s1.spec_proposed - s0.spec_proposed
                        got[1] += s1.spec_accepted - s0.spec_accepted
                        got[2] += s1.spec_steps - s0.spec_steps
                        print(f"  {wl} C={c} {name}: {rate:.1f} tok/s ({toks} tokens, {dt:.1f} s)", flush=True)
                        if name == "off":
                            base_rate, base_texts = rate, texts
                        else:
                            ratios.setdefault(key, []).append(rate / base_rate)
                            same[key] = same.get(key, True) and texts == base_texts
        nursery.cancel_scope.cancel()
    print(f"\n{'workload':<8} {'C':>2} {'engine':<7} {'tok/s':>8} {'x off':>6} {'accept':>7} "
          f"{'prop/step':>9} {'same text':>9}")
    for wl in WORKLOADS:
        for c in levels:
            for name in configs:
                key = (wl, name, c)
                med = statistics.median(rates[key])
                if name == "off":
                    print(f"{wl:<8} {c:>2} {name:<7} {med:>8.1f} {'':>6} {'':>7} {'':>9} {'':>9}")
                    continue
                p, a, steps = counts[key]
                acc = f"{a / p:.0%}" if p else "-"
                per = f"{p / steps:.2f}" if steps else "-"
                print(f"{wl:<8} {c:>2} {name:<7} {med:>8.1f} {statistics.median(ratios[key]):>6.2f} {acc:>7} "
                      f"{per:>9} {'-' if args.temperature else 'yes' if same[key] else 'NO':>9}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--lookup", type=int, default=4, help="prompt_lookup tokens")
    ap.add_argument("--draft", default=None, help="a draft model directory")
    ap.add_argument("--draft-layers", type=int, default=0, help="make a draft of the model's first N layers")
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled requests at this temperature")
    trio.run(main, ap.parse_args())
