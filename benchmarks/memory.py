"""Where a served model's memory goes: resident set and MLX's counters, per prompt.

    .venv/bin/python benchmarks/memory.py [--model default|random|DIR|FILE.gguf]
        [--prompts 512,4096,8000] [--malloc tuned,system] [--prefix-cache-bytes 0]

For each ``--malloc`` setting (``tuned``: afm's default, glibc's mmap
threshold fixed, ``afm_core._mlx.malloc``; ``system``: ``AFM_MALLOC=system``,
glibc's moving threshold) a fresh process opens an engine on the model
(defaults otherwise; the prefix cache off unless ``--prefix-cache-bytes``
says, as in ``afm bench --real-model``) and sends one prompt of each length
in turn (raw token ids, greedy, 8 tokens).  Printed after the engine started
and after each prompt: the process's resident set (``VmRSS``) and its peak
(``VmHWM``), and MLX's memory in use (``mx.get_active_memory``: weights and KV
caches), its cache of freed buffers (``mx.get_cache_memory``) and its peak
during that prompt (``mx.get_peak_memory``, reset before each).  ``kv`` is
the KV cache of that prompt's length (``kv_memory.kv_bytes_per_token`` of
the loaded model, in the engine's KV type); ``s`` the prompt's wall time
(its prefill and 8 tokens), to see what a setting costs beside what it
saves.  Other settings go in the environment, which the engine's process
inherits (``AFM_NO_QMM_SWIGLU=1 ... memory.py``, say).

Memory is not a timing: one run says it (the settings alternate anyway); the
seconds compare only between settings of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import model_path  # (first: imports afm_core before mlx)

# isort: split
import mlx.core as mx
import trio

from afm_core import CompletionRequest, Finish, open_engine
from afm_core._engine.kv_memory import kv_bytes_per_token
from afm_core.bench._servers import peak_rss_bytes

MIB = 1 << 20


def sample(what: str, tokens: int = 0, kv: int = 0, seconds: float = 0.0) -> dict[str, object]:
    rss = peak_rss_bytes(os.getpid()) or {}
    return {"what": what, "tokens": tokens, "kv": kv, "seconds": seconds, "VmRSS": rss.get("current", 0), "VmHWM": rss.get("peak", 0),
            "active": mx.get_active_memory(), "cache": mx.get_cache_memory(), "peak": mx.get_peak_memory()}


async def child(model: str, prompts: list[int], prefix_cache_bytes: int) -> None:
    async with open_engine(model, prefix_cache_bytes=prefix_cache_bytes) as engine:
        assert engine._worker is not None
        per_token = kv_bytes_per_token(engine._worker.model, half=engine.statistics().kv_cache == "float16")
        print(json.dumps(sample("started")), flush=True)
        for n in prompts:
            ids = tuple(100 + (i * 7919 + n) % 20000 for i in range(n))
            req = CompletionRequest.from_openai({"max_tokens": 8, "temperature": 0, "ignore_eos": True}, ids)
            mx.reset_peak_memory()
            start = time.perf_counter()
            async with engine.stream(req) as s:
                async for e in s:
                    if isinstance(e, Finish):
                        break
            print(json.dumps(sample("prompt", n, n * per_token, time.perf_counter() - start)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", default="512,4096,8000")
    ap.add_argument("--malloc", default="tuned,system")
    ap.add_argument("--prefix-cache-bytes", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    prompts = [int(x) for x in args.prompts.split(",")]
    if args.child:
        trio.run(child, args.model, prompts, args.prefix_cache_bytes)
        return
    with tempfile.TemporaryDirectory() as work:
        model = model_path(args.model, Path(work))
        print(f"model {model}; prompts {prompts}; prefix cache {args.prefix_cache_bytes >> 20} MiB")
        print("| malloc | after | VmRSS MiB | VmHWM MiB | MLX active | MLX cache | MLX peak | kv MiB | s |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for setting in args.malloc.split(","):
            env = {k: v for k, v in os.environ.items() if k not in ("AFM_MALLOC", "MALLOC_MMAP_THRESHOLD_")}
            if setting == "system":
                env["AFM_MALLOC"] = "system"
            elif setting != "tuned":
                ap.error(f"--malloc: tuned or system, not {setting!r}")
            run = subprocess.run([sys.executable, __file__, "--child", "--model", str(model),
                                  "--prompts", args.prompts, "--prefix-cache-bytes", str(args.prefix_cache_bytes)],
                                 env=env, capture_output=True, text=True, check=False)
            if run.returncode != 0:
                sys.exit(f"{setting}: the engine failed:\n{run.stderr[-2000:]}")
            for line in run.stdout.splitlines():
                if not line.startswith("{"):
                    continue
                s = json.loads(line)
                after = "start" if s["what"] == "started" else f"{s['tokens']} tokens"
                kv = f"{s['kv'] / MIB:.0f}" if s["kv"] else ""
                secs = f"{s['seconds']:.2f}" if s["seconds"] else ""
                print(f"| {setting} | {after} | {s['VmRSS'] // MIB} | {s['VmHWM'] // MIB} | {s['active'] // MIB} "
                      f"| {s['cache'] // MIB} | {s['peak'] // MIB} | {kv} | {secs} |")


if __name__ == "__main__":
    main()
