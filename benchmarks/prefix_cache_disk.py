"""The prefix cache's disk tier: TTFT of an agent's next turn after a restart.

    .venv/bin/python benchmarks/prefix_cache_disk.py [--model random|default|DIR]
        [--prefix 2048,4096,8192] [--turns 4] [--user-tokens 200] [--repeats 3]

A multi-turn agent workload on raw token ids (``CompletionRequest``): a
shared prefix of ``--prefix`` tokens (system prompt and tool definitions),
then ``--turns`` turns, each adding a 32-token reply and a
``--user-tokens`` message to the conversation (``max_tokens`` 1: only the
first token matters here).  An engine with a memory and a disk tier
(``cache_dir``) serves turns 1 to T-1; its directory is then snapshotted
(hard links: entries are replaced by rename, never changed in place), and
the next turn T is timed (the engine's profile ``ttft_s``: submission to
first token) in four situations:

* ``cold``: an engine without a prefix cache: the whole prompt is prefilled;
* ``memory``: the same engine that served turns 1 to T-1 (warm memory tier);
* ``disk``: a fresh engine on the snapshot (a restart): the entry is read
  from disk (the file in the page cache, as after a process restart);
* ``disk-cold``: the same on another snapshot whose files were dropped from
  the page cache first (``posix_fadvise DONTNEED``: as after a reboot);
* ``new-session``: a fresh engine on a snapshot, a new conversation's first
  turn (the shared prefix, another user message): the shared prefix comes
  from the disk entry of the other conversation, trimmed.

Each cell is the median over ``--repeats`` conversations (other random
ids); ``cached`` is the prompt tokens served from the cache and ``tier``
the profile's ``prefix_tier``.  Also reported: the disk entry's size and
the I/O thread's time to write and to read (and checksum) it, and the
generation thread's time spent handing an entry to the I/O thread.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import afm_core  # noqa: F401  (first: binds MLX's BLAS)

# isort: split
import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

import trio

from afm_core import CompletionRequest, Profile, open_engine
from afm_core._mlx import disk_cache
from afm_core.testing import make_random_model

TIMES: dict[str, list[tuple[float, int]]] = defaultdict(list)  # I/O and hand-off timings: (seconds, bytes)


def timed(name: str, fn: Any, size: Any) -> Any:
    def wrapper(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        TIMES[name].append((time.perf_counter() - t0, size(out, *args)))  # (from either thread: list.append)
        return out
    return wrapper


def instrument() -> None:
    disk_cache.write_entry = timed("write", disk_cache.write_entry, lambda out, *a: out)
    disk_cache.read_entry = timed("read", disk_cache.read_entry, lambda out, *a: out[0].size)
    save = disk_cache.DiskPromptCache.save
    disk_cache.DiskPromptCache.save = timed("hand-off", save, lambda out, *a: 0)  # type: ignore[method-assign]


def model_path(spec: str, work: Path, context: int) -> Path:
    if spec == "random":
        return make_random_model(work / "random", context_length=context)
    if spec == "default":
        from afm_core import resolve_model
        return Path(resolve_model(None))
    return Path(spec)


def conversation(rng: random.Random, vocab: int, prefix: list[int], turns: int, user: int) -> list[list[int]]:
    """The prompts of turns 1..turns (each the previous one, a reply and a user message)."""
    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]
    prompts = [prefix + ids(user)]
    for _ in range(turns - 1):
        prompts.append(prompts[-1] + ids(32) + ids(user))
    return prompts


async def turn(engine: Any, ids: list[int]) -> dict[str, Any]:
    req = CompletionRequest.from_openai({"temperature": 0, "max_tokens": 1, "ignore_eos": True}, tuple(ids))
    async with engine.stream(req, profile="basic") as s:
        events = [e async for e in s]
    return next(e for e in events if isinstance(e, Profile)).payload


async def written(engine: Any, n: int) -> None:
    with trio.fail_after(600):  # a hang guard
        while True:  # (the engine has no event for it: its statistics are polled)
            if engine.statistics().prefix_cache_disk_writes >= n:
                return
            await trio.sleep(0.01)


def snapshot(src: Path, dst: Path, drop_page_cache: bool = False) -> Path:
    dst.mkdir(parents=True)
    for f in src.glob("afmkv-*.safetensors"):
        target = dst / f.name
        if drop_page_cache:
            shutil.copyfile(f, target)  # (its own pages: dropping them leaves the source's alone)
            fd = os.open(target, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        else:
            os.link(f, target)
    return dst


async def one_size(path: Path, vocab: int, prefix_len: int, args: argparse.Namespace, work: Path,
                   cold_engine: Any) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in range(args.repeats):
        rng = random.Random(prefix_len * 100 + r)
        prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
        prompts = conversation(rng, vocab, prefix, args.turns, args.user_tokens)
        fresh = prefix + [rng.randrange(3, vocab) for _ in range(args.user_tokens)]
        base = work / f"p{prefix_len}-r{r}"
        async with open_engine(path, cache_dir=base / "live", max_batch=4) as engine:
            for ids in prompts[:-1]:
                await turn(engine, ids)
            await written(engine, len(prompts) - 1)
            snaps = [snapshot(base / "live", base / "snap"), snapshot(base / "live", base / "snap-new")]
            cold_snap = snapshot(base / "live", base / "snap-cold", drop_page_cache=True)
            results["memory"].append(await turn(engine, prompts[-1]))
        async with open_engine(path, cache_dir=snaps[0], max_batch=4) as engine:
            results["disk"].append(await turn(engine, prompts[-1]))
        async with open_engine(path, cache_dir=cold_snap, max_batch=4) as engine:
            results["disk-cold"].append(await turn(engine, prompts[-1]))
        async with open_engine(path, cache_dir=snaps[1], max_batch=4) as engine:
            results["new-session"].append(await turn(engine, fresh))
        results["cold"].append(await turn(cold_engine, prompts[-1]))
        results["cold new-session"].append(await turn(cold_engine, fresh))
        shutil.rmtree(base)
    return results


async def main_async(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="afm-bench-disk-"))
    sizes = [int(x) for x in args.prefix.split(",")]
    longest = max(sizes) + args.turns * (args.user_tokens + 32) + 64
    path = model_path(args.model, work, context=max(longest, 4096))
    instrument()
    try:
        async with open_engine(path, prefix_cache_bytes=0, max_batch=4) as cold_engine:
            vocab = 1000  # (ids 3-999: in both models' vocabularies)
            if cold_engine.context_length < longest:
                raise SystemExit(f"the model's context ({cold_engine.context_length}) is shorter than "
                                 f"the longest prompt ({longest}): smaller --prefix or --turns")
            print(f"model {path.name}; {args.turns} turns of {args.user_tokens}+32 tokens after the shared "
                  f"prefix; next-turn TTFT, median of {args.repeats}")
            print(f"{'prefix':>7} {'prompt':>7} {'situation':>17} {'ttft_s':>8} {'cached':>7} {'tier':>7} "
                  f"{'vs cold':>8}")
            for size in sizes:
                TIMES.clear()
                res = await one_size(path, vocab, size, args, work, cold_engine)
                cold = statistics.median(p["ttft_s"] for p in res["cold"])
                cold_new = statistics.median(p["ttft_s"] for p in res["cold new-session"])
                for name in ("cold", "memory", "disk", "disk-cold", "new-session", "cold new-session"):
                    rows = res[name]
                    ttft = statistics.median(p["ttft_s"] for p in rows)
                    ref = cold_new if "new-session" in name else cold
                    tiers = sorted({str(p["prefix_tier"]) for p in rows})
                    print(f"{size:>7} {rows[0]['prompt_tokens']:>7} {name:>17} {ttft:>8.4f} "
                          f"{statistics.median(p['cached_tokens'] for p in rows):>7.0f} {'/'.join(tiers):>7} "
                          f"{ref / ttft:>7.1f}x")
                for name in ("write", "read", "hand-off"):
                    got = TIMES.get(name, [])
                    if not got:
                        continue
                    if name == "hand-off":
                        secs = statistics.median(t for t, _ in got)
                        print(f"{'':>7} generation thread's hand-off of an entry to write: median "
                              f"{secs * 1000:.2f} ms, max {max(t for t, _ in got) * 1000:.2f} ms ({len(got)})")
                        continue
                    big = max(b for _, b in got)
                    secs = statistics.median(t for t, b in got if b == big)
                    print(f"{'':>7} I/O thread: {name} of the largest entry ({big / 1e6:.1f} MB): "
                          f"{secs * 1000:.1f} ms ({big / secs / 1e9:.2f} GB/s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random", help="random (the tiny test model, long context), default, or DIR")
    ap.add_argument("--prefix", default="2048,4096,8192", help="shared prefix lengths, comma-separated")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    trio.run(main_async, ap.parse_args())


if __name__ == "__main__":
    main()
