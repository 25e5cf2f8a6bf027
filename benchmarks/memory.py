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
during that prompt (``mx.get_peak_memory``, reset before each).  The KV
cache a prompt leaves is ``kv`` (float16: the model's layers x 2 x KV heads x
head size x 2 bytes per token).

Memory is not a timing: one run says it (the settings alternate anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import model_path  # (first: imports afm_core before mlx)

# isort: split
import mlx.core as mx
import trio

from afm_core import CompletionRequest, Finish, open_engine

MIB = 1 << 20


def status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def sample(what: str, tokens: int = 0) -> dict[str, object]:
    return {"what": what, "tokens": tokens, **status(), "active": mx.get_active_memory(),
            "cache": mx.get_cache_memory(), "peak": mx.get_peak_memory()}


async def child(model: str, prompts: list[int], prefix_cache_bytes: int) -> None:
    async with open_engine(model, prefix_cache_bytes=prefix_cache_bytes) as engine:
        print(json.dumps(sample("started")), flush=True)
        for n in prompts:
            ids = tuple(100 + (i * 7919 + n) % 20000 for i in range(n))
            req = CompletionRequest.from_openai({"max_tokens": 8, "temperature": 0, "ignore_eos": True}, ids)
            mx.reset_peak_memory()
            async with engine.stream(req) as s:
                async for e in s:
                    if isinstance(e, Finish):
                        break
            print(json.dumps(sample("prompt", n)), flush=True)


def kv_per_token(model: Path) -> int:
    """Float16 KV bytes per token from the model's config (0 if it says too little)."""
    try:
        cfg = json.loads((model / "config.json").read_text())
        heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return int(cfg["num_hidden_layers"]) * 2 * int(heads) * int(dim) * 2
    except (OSError, KeyError, ValueError, TypeError):
        return 0


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
        per_token = kv_per_token(model) if model.is_dir() else 0
        print(f"model {model}; prompts {prompts}; prefix cache {args.prefix_cache_bytes >> 20} MiB")
        print("| malloc | after | VmRSS MiB | VmHWM MiB | MLX active | MLX cache | MLX peak | kv MiB |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
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
                kv = f"{s['tokens'] * per_token / MIB:.0f}" if per_token and s["tokens"] else ""
                print(f"| {setting} | {after} | {s['VmRSS'] // MIB} | {s['VmHWM'] // MIB} | {s['active'] // MIB} "
                      f"| {s['cache'] // MIB} | {s['peak'] // MIB} | {kv} |")


if __name__ == "__main__":
    main()
