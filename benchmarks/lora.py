"""What LoRA adapters cost the engine's decode: tokens/s with and without them.

    .venv/bin/python benchmarks/lora.py [--model random,default] [--keys qv,all] [--levels 1,4]
                                        [--tokens 64] [--rounds 3]

For each model (``random``: the tiny random test model; ``default``: afm's
default model; or a directory) and each adapter shape (``qv``: rank 8 on
``q_proj`` and ``v_proj``, mlx-lm's usual choice; ``all``: rank 8 on every
projection of every layer), two random adapters are written with mlx-lm's
tuner (``afm_core.testing.make_lora_adapter(random=True)``) and two engines
are opened in this process: one serving no adapters, one serving both.
Each round runs, at each concurrency C, C greedy raw completions of
``--tokens`` tokens (``ignore_eos``, distinct random prompts, no prefix
cache) in each mode, the modes interleaved round by round:

* ``off``: the engine without adapters (what afm did before);
* ``none``: the engine with adapters, rows without one (the wrappers' cost);
* ``one``: every row on adapter 1;
* ``mixed``: rows alternating between adapters 1 and 2 (one batch, a
  gathered product per layer); at C=1 its one row is on adapter 1, the same
  work as ``one`` (the two columns then show the noise).

Decode tok/s is each stream's tokens after its first over the time from its
first to its last token, summed over the C streams; the table gives the
median over rounds and its ratio to ``off``.  Before the table, the MLX
operations in one decode forward at C=4 in each mode (the model with the
engine's CPU rewrite and the adapters attached, as the engine runs it): on
the CPU backend a small model's step costs about in proportion to them.
``--ops-only`` prints those counts and skips the timing.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import model_path  # first: binds the BLAS under MLX (see there)

# isort: split
import argparse
import random
import statistics
import tempfile
import time

import mlx.core as mx
import trio

from afm_core import CompletionRequest, Engine, open_engine
from afm_core.testing import make_lora_adapter

KEYS = {"qv": ("self_attn.q_proj", "self_attn.v_proj"),
        "all": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
MODES = ("off", "none", "one", "mixed")


async def stream_rate(engine: Engine, prompt: list[int], tokens: int, adapter: str | None) -> float:
    request = CompletionRequest(prompt=tuple(prompt), max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                adapter=adapter)
    stamps = []
    async with engine.stream(request) as s:
        async for batch in s.batches():
            if any(type(e).__name__ == "ContentDelta" for e in batch):
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise SystemExit("a stream gave fewer than two tokens")
    # tokens after the first, over their time (a batch may carry several when the reader fell behind)
    return (tokens - 1) / (stamps[-1] - stamps[0])


async def run_level(engine: Engine, level: int, tokens: int, mode: str, rng: random.Random) -> float:
    adapters = {"off": [None], "none": [None], "one": ["a1"], "mixed": ["a1", "a2"]}[mode]
    rates: list[float] = []

    async def one(i: int) -> None:
        prompt = [rng.randrange(10, 500) for _ in range(16)]
        rates.append(await stream_rate(engine, prompt, tokens, adapters[i % len(adapters)]))

    async with trio.open_nursery() as nursery:
        for i in range(level):
            nursery.start_soon(one, i)
    return sum(rates)


def step_ops(model_dir: Path, adapters: list[tuple[str, str]], c: int = 4) -> dict[str, int]:
    """MLX operations in one decode forward of ``c`` rows, in each mode."""
    import re
    import tempfile

    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from afm_core._mlx.fusion import fuse_for_cpu, unfuse_cpu_kernels
    from afm_core._mlx.lora import attach_adapters, detach_adapters

    model = mlx_lm.load(str(model_dir))[0]
    fuse_for_cpu(model)
    rows = attach_adapters(model, adapters)
    counts = {}
    for mode, of in (("none", {}), ("one", dict.fromkeys(range(c), 1)),
                     ("mixed", {i: 1 + i % 2 for i in range(c)})):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[5, 6, 7]] * c), cache=cache), [x.state for x in cache])
        rows.of = of
        rows.select_rows(list(range(c)))
        out = model(mx.array([[9]] * c), cache=cache)
        rows.clear()
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
            mx.export_to_dot(f.name, out)
            counts[mode] = len(re.findall(r'label ?= ?"([A-Za-z][^"]*)", shape=rectangle', f.read()))
    detach_adapters(model)
    unfuse_cpu_kernels(model)
    return counts


async def bench(model: Path, keys: str, levels: list[int], tokens: int, rounds: int, work: Path,
                ops_only: bool = False) -> None:
    a1 = make_lora_adapter(model, work / f"{keys}-a1", keys=KEYS[keys], rank=8, random=True, seed=1)
    a2 = make_lora_adapter(model, work / f"{keys}-a2", keys=KEYS[keys], rank=8, random=True, seed=2)
    ops = step_ops(model, [("a1", str(a1)), ("a2", str(a2))])
    print(f"\n{model.name}  adapters rank 8 on {keys} ({', '.join(k.split('.')[-1] for k in KEYS[keys])})")
    print("operations in one decode forward, C=4: " + ", ".join(f"{m} {n}" for m, n in ops.items()))
    if ops_only:
        return
    common = {"prefix_cache_bytes": 0, "max_batch": max(levels)}
    rng = random.Random(0)
    async with open_engine(model, **common) as plain, \
            open_engine(model, adapters=(("a1", str(a1)), ("a2", str(a2))), **common) as adapted:
        results: dict[tuple[int, str], list[float]] = {}
        for r in range(rounds):
            for level in levels:
                order = MODES if r % 2 == 0 else tuple(reversed(MODES))
                for mode in order:
                    engine = plain if mode == "off" else adapted
                    rate = await run_level(engine, level, tokens, mode, rng)
                    results.setdefault((level, mode), []).append(rate)
    print(f"{'C':>3} " + " ".join(f"{m + ' tok/s':>12}" for m in MODES) + "   ratios to off (none/one/mixed)")
    for level in levels:
        med = {m: statistics.median(results[(level, m)]) for m in MODES}
        ratios = " / ".join(f"{med[m] / med['off']:.2f}" for m in MODES[1:])
        print(f"{level:>3} " + " ".join(f"{med[m]:>12.1f}" for m in MODES) + f"   {ratios}")


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="afm-lora-bench-"))
    levels = [int(x) for x in args.levels.split(",")]
    for spec in args.model.split(","):
        model = model_path(spec, work)
        for keys in args.keys.split(","):
            await bench(model, keys, levels, args.tokens, args.rounds, work / spec.replace("/", "_"),
                        args.ops_only)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random,default")
    p.add_argument("--keys", default="qv,all")
    p.add_argument("--levels", default="1,4")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ops-only", action="store_true", help="only count the operations of a decode step")
    trio.run(main, p.parse_args())
