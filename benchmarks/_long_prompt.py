"""Long prompts, afm against llama.cpp on the same GGUF: time to first token and peak RSS.

Driven by ``benchmarks/prefill.py --long 512,4096,8000`` (see there and
benchmarks/README.md).  Every measurement runs in a child process of its own (this module
with ``child``), so each one's peak resident memory (``VmHWM``, the model's
load included) is its own; the parent alternates afm and llama.cpp, length
by length, round by round, and prints medians and ratios.

afm's child opens the engine with its defaults (``open_engine``: prefill
chunks of 2048, the CPU kernels, the warm-up) and times a raw-token
completion of one token; a model directory without a tokenizer (a converted
GGUF's weights only) runs the engine's batch generator instead
(``EngineBatchGenerator``, the same prefill).  llama.cpp's child
(llama-cpp-python) loads the GGUF with a context of the prompt plus 8 tokens,
flash attention on (llama-server's ``auto`` picks it on the CPU), and times
``create_completion`` of one token.  Both warm up on a short prompt first and
use ``--threads`` threads; the prompts are the same token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["compare", "prompt_ids"]


def prompt_ids(n: int, vocab: int) -> list[int]:
    """``n`` token ids, the same on both sides (no special tokens: ids from 100)."""
    top = min(vocab - 16, 30000)
    return [100 + (i * 7919 + 13) % (top - 100) for i in range(n)]


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _afm(model: str, n: int) -> dict[str, Any]:
    import afm_core  # noqa: F401  (binds the BLAS first)

    path = Path(model)
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        return _afm_engine(model, n)
    return _afm_generator(model, n)


def _afm_engine(model: str, n: int) -> dict[str, Any]:
    import trio

    from afm_core import CompletionRequest, ContentDelta, Finish, LogprobsDelta, open_engine

    result: dict[str, Any] = {}

    async def main() -> None:
        async with open_engine(model) as engine:
            vocab = json.loads((Path(model) / "config.json").read_text()).get("vocab_size", 30000)
            ids = prompt_ids(n, int(vocab))
            req = CompletionRequest.from_openai({"max_tokens": 1, "temperature": 0, "ignore_eos": True},
                                                tuple(ids))
            t0, c0 = time.perf_counter(), time.process_time()
            async with engine.stream(req) as s:
                async for e in s:
                    if isinstance(e, ContentDelta | LogprobsDelta | Finish):
                        break
            result.update(ttft=time.perf_counter() - t0, cpu=time.process_time() - c0, path="engine")

    trio.run(main)
    return result


def _afm_generator(model: str, n: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from afm_core._mlx.fusion import fuse_for_cpu
    from afm_core._mlx.prefill import EngineBatchGenerator

    m, config = load_model(Path(model))
    fuse_for_cpu(m)
    ids = prompt_ids(n, int(config.get("vocab_size", 30000)))

    def first_token(prompt: list[int]) -> None:
        gen = EngineBatchGenerator(m, logprob_uids=set(), stop_tokens=[], prefill_step_size=2048,
                                   prefill_step_decoding=256)
        gen.insert([prompt], max_tokens=[1])
        while not gen.next()[1]:
            pass
        gen.close()
        mx.clear_cache()

    first_token(ids[:64])  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    first_token(ids)
    return {"ttft": time.perf_counter() - t0, "cpu": time.process_time() - c0, "path": "generator"}


def _llama(gguf: str, n: int, threads: int) -> dict[str, Any]:
    import llama_cpp

    llm = llama_cpp.Llama(gguf, n_ctx=n + 8, n_threads=threads, n_threads_batch=threads,
                          flash_attn=True, verbose=False)
    ids = prompt_ids(n, llm.n_vocab())
    llm.create_completion(ids[:64], max_tokens=1, temperature=0)  # warm-up
    llm.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    llm.create_completion(ids, max_tokens=1, temperature=0)
    return {"ttft": time.perf_counter() - t0, "cpu": time.process_time() - c0, "path": "llama-cpp-python"}


def child(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("side", choices=("afm", "llama"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    out = _afm(args.model, args.tokens) if args.side == "afm" else _llama(args.gguf, args.tokens, args.threads)
    out.update(hwm=_vm("VmHWM"), rss=_vm("VmRSS"))
    print("RESULT " + json.dumps(out), flush=True)


def _run(side: str, model: str, gguf: str, n: int, threads: int, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, AFM_QMM_THREADS=str(threads), AFM_BLAS_THREADS=str(threads))
    cmd = [sys.executable, __file__, "child", side, "--model", model, "--gguf", gguf,
           "--tokens", str(n), "--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT "):])
            return result
    raise SystemExit(f"{side} at {n} tokens failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def compare(model: str, gguf: str, lengths: list[int], rounds: int, threads: int,
            timeout: float = 3600.0) -> None:
    """Print TTFT and peak RSS of afm and llama.cpp at each length (medians of ``rounds``)."""
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in range(rounds):
        for n in lengths:
            order = ("afm", "llama") if r % 2 == 0 else ("llama", "afm")
            for side in order:
                got = _run(side, model, gguf, n, threads, timeout)
                results.setdefault((side, n), []).append(got)
                print(f"  round {r + 1} {side:>5} {n:>6} tokens: {got['ttft']:8.2f} s  "
                      f"cpu {got['cpu']:8.2f} s  VmHWM {got['hwm'] / 2**20:7.0f} MiB", flush=True)
    print(f"\n{'tokens':>7} {'afm TTFT':>9} {'llama.cpp':>10} {'ratio':>6} {'afm CPU-s':>10} "
          f"{'llama CPU-s':>11} {'afm HWM':>8} {'llama HWM':>10} {'ratio':>6}   "
          "(medians; ratios: llama.cpp / afm for time, afm / llama.cpp for memory)")
    for n in lengths:
        a, b = results[("afm", n)], results[("llama", n)]

        def med(rows: list[dict[str, Any]], k: str) -> float:
            return statistics.median(x[k] for x in rows)

        ttft_ratio = med(b, "ttft") / med(a, "ttft")
        mem_ratio = med(a, "hwm") / med(b, "hwm")
        print(f"{n:>7} {med(a, 'ttft'):8.2f}s {med(b, 'ttft'):9.2f}s {ttft_ratio:6.2f} {med(a, 'cpu'):10.2f} "
              f"{med(b, 'cpu'):11.2f} {med(a, 'hwm') / 2**20:6.0f}Mi {med(b, 'hwm') / 2**20:8.0f}Mi "
              f"{mem_ratio:6.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        child(sys.argv[2:])
