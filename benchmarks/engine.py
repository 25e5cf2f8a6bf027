"""In-process engine throughput vs raw mlx-lm ``BatchGenerator``, same run.

    .venv/bin/python benchmarks/engine.py [--model DIR] [--levels 1,8,32] [--max-tokens 256] [--fused-raw]

For each concurrency level C, 4*C requests (``--requests-per-stream``) with the same seeded prompts go
through (a) mlx-lm's BatchGenerator driven directly with completion batch C
(the physical limit: no detokenizer, no Trio, no pipeline) and (b)
``afm_core.open_engine(max_batch=C)`` with every request streamed by a Trio
task.  Raw and ours alternate ``--repeats`` times; the median of the paired
ratios is reported (the machine's noise hits both sides alike).  Greedy decoding, so both generate the same tokens.  Prints aggregate
completion tokens/s and the ratio ours/raw.  The default model is the random
tiny test model (float32), so engine overhead is visible.

With ``--threads`` (Linux) each level also prints the CPU each thread used
during the timed part, in cores (CPU seconds / wall seconds, mean over the
repeats): the main thread (raw's loop; Trio for ours), the engine's
generation thread and MLX's native worker threads.  CPU time is steadier
than tokens/s on a noisy machine and shows where the cores go.

The engine runs the model with its fused CPU kernels (``afm_core._mlx.fusion``);
raw runs mlx-lm's model as is.  ``--fused-raw`` adds raw with the same
kernels, to show the engine's own cost apart from the kernels' gain.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import trio

import afm_core
from afm_core.testing import make_random_model

WORDS = "the quick brown fox jumps over a lazy dog while local inference streams tokens".split()


def prompts(n: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(20, 60))) for _ in range(n)]


class ThreadCPU:
    """Per-thread CPU seconds of this process between ``start`` and ``stop`` (Linux /proc)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._t0 = 0.0
        self._c0: dict[int, float] = {}
        self.wall = 0.0

    @staticmethod
    def _snapshot() -> dict[int, float]:
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended
                continue
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
        return out

    def start(self) -> None:
        self._c0, self._t0 = self._snapshot(), time.perf_counter()

    def stop(self) -> None:
        self.wall += time.perf_counter() - self._t0
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid, cpu in self._snapshot().items():
            role = "main" if tid == os.getpid() else names.get(tid, "native (MLX)")
            self.totals[role] = self.totals.get(role, 0.0) + cpu - self._c0.get(tid, 0.0)

    def report(self) -> str:
        parts = [(role, sec / self.wall) for role, sec in self.totals.items() if sec / self.wall >= 0.01]
        return ", ".join(f"{role} {cores:.2f}" for role, cores in sorted(parts, key=lambda p: -p[1]))


def raw(model_dir: Path, texts: list[str], concurrency: int, max_tokens: int,
        cpu: ThreadCPU | None = None, fused: bool = False) -> tuple[int, float]:
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    from afm_core._mlx.fusion import fuse_cpu_kernels, unfuse_cpu_kernels

    model, tok = mlx_lm.load(str(model_dir))
    if fused:
        fuse_cpu_kernels(model)
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
           for t in texts]
    gen = BatchGenerator(model, stop_tokens=[[e] for e in tok.eos_token_ids],
                         completion_batch_size=concurrency,
                         prefill_batch_size=min(8, concurrency))
    # warm-up
    gen.insert(ids[:1], max_tokens=[4])
    while gen.next_generated():
        pass
    if cpu:
        cpu.start()
    t0 = time.perf_counter()
    gen.insert(ids, max_tokens=[max_tokens] * len(ids))
    tokens = 0
    while True:
        out = gen.next_generated()
        if not out:
            break
        tokens += len(out)
    dt = time.perf_counter() - t0
    if cpu:
        cpu.stop()
    gen.close()
    unfuse_cpu_kernels(model)  # frees the compiled traces on this thread
    return tokens, dt


async def ours(model_dir: Path, texts: list[str], concurrency: int, max_tokens: int,
               cpu: ThreadCPU | None = None) -> tuple[int, float]:
    async with afm_core.open_engine(model_dir, max_batch=concurrency, max_waiting=len(texts),
                                    prefix_cache_bytes=0) as engine:
        warm = afm_core.ChatRequest.from_openai(
            {"messages": [{"role": "user", "content": texts[0]}], "max_tokens": 4, "temperature": 0})
        await engine.complete(warm)
        total = 0

        async def one(text: str) -> None:
            nonlocal total
            r = afm_core.ChatRequest.from_openai({"messages": [{"role": "user", "content": text}],
                                                  "max_tokens": max_tokens, "temperature": 0})
            async with engine.stream(r) as s:
                async for ev in s:
                    if isinstance(ev, afm_core.Usage):
                        total += ev.completion_tokens

        if cpu:
            cpu.start()
        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for t in texts:
                n.start_soon(one, t)
        dt = time.perf_counter() - t0
        if cpu:
            cpu.stop()
        return total, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7, help="paired runs (raw, ours) per level")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--threads", action="store_true", help="also print CPU per thread (Linux)")
    ap.add_argument("--fused-raw", action="store_true",
                    help="also run raw with the engine's fused CPU kernels (the engine's own cost apart)")
    args = ap.parse_args()
    model = args.model or make_random_model(Path(tempfile.mkdtemp()) / "tiny")
    print(f"model: {model}\n")
    print(f"{'C':>4} {'raw tok/s':>10} {'ours tok/s':>11} {'ratio':>6}  (medians)")
    for c in [int(x) for x in args.levels.split(",")]:
        texts = prompts(args.requests_per_stream * c, seed=c)
        pairs = []
        fused_rates = []
        raw_cpu, our_cpu = (ThreadCPU(), ThreadCPU()) if args.threads else (None, None)
        for _ in range(args.repeats):  # alternate, so both sides see the same machine
            rt, rd = raw(model, texts, c, args.max_tokens, raw_cpu)
            ot, od = trio.run(ours, model, texts, c, args.max_tokens, our_cpu)
            pairs.append((rt / rd, ot / od))
            if args.fused_raw:
                ft, fd = raw(model, texts, c, args.max_tokens, fused=True)
                fused_rates.append(ft / fd)
        ratios = sorted(o / r for r, o in pairs)
        r_rate = statistics.median(r for r, _ in pairs)
        o_rate = statistics.median(o for _, o in pairs)
        print(f"{c:>4} {r_rate:>10.1f} {o_rate:>11.1f} {statistics.median(ratios):>6.3f}   "
              f"(paired ratios {', '.join(f'{x:.2f}' for x in ratios)}; {rt} tokens per run)")
        if fused_rates:
            own = sorted(o / f for (_, o), f in zip(pairs, fused_rates, strict=True))
            print(f"{'':>6}raw with fused kernels {statistics.median(fused_rates):.1f} tok/s; "
                  f"ours / that {statistics.median(own):.3f} (paired {', '.join(f'{x:.2f}' for x in own)})")
        if raw_cpu and our_cpu:
            print(f"{'':>6}cores  raw: {raw_cpu.report()}\n{'':>6}cores ours: {our_cpu.report()}")


if __name__ == "__main__":
    main()
