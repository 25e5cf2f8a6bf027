"""Two models in one ``afm serve``: what a load costs its first request, and
what it costs the other model's streams.

    .venv/bin/python benchmarks/many_models.py [--model random|default|DIR] [--rounds 3] [--tokens 300] [--no-warmup]

One server (a fresh process: ``afm serve --model A --model B --keep-alive -1``)
serves model A and model B (``--model random``: two tiny random test models;
``default``: afm's default model, B being a second directory linking to the
same files, so it loads a second copy; DIR: that model twice, the same way).
Every round:

* **load vs no load, interleaved** (the order alternates round by round): a
  streamed completion on A (``--tokens`` tokens, ``ignore_eos``); in one run,
  once A's 20th token arrived, the first request to B (unloaded) is sent, and
  A's inter-token gaps are kept from then until B's first token (B loading and
  warming up); in the other run nothing else happens and A's gaps after its
  20th token are kept.  The table gives the gaps' median and maximum over all
  rounds, and how many of A's tokens arrived while B loaded.
* **time to first token of B**: the first request after B was unloaded
  (``keep_alive: 0`` unloads it after each measurement), load included, vs
  the next request to B, loaded.

``--no-warmup`` passes ``afm serve --no-warmup``: a load is then the weights
alone, without the engine's start-up requests (which run on B's thread and
so compete with A's for the CPU).  Times are taken at the client (httpx), from the request's start to the
first content byte, and between SSE data lines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import model_path

PROMPT = "Once upon a time"
SKIP = 20  # A's tokens before B's request goes out


class Server:
    def __init__(self, models: list[Path], extra: list[str]) -> None:
        argv = [sys.executable, "-m", "afm_core._cli", "serve", "--port", "0", "--quiet",
                "--keep-alive", "-1", *extra]
        for path in models:
            argv += ["--model", str(path)]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        assert self.proc.stderr is not None
        self.url = ""
        for line in self.proc.stderr:
            if m := re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line):
                self.url = m.group(1)
                break
        if not self.url:
            self.proc.kill()
            raise SystemExit("afm serve did not start")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for _ in self.proc.stderr:
            pass

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def state(c: httpx.Client, model: str) -> str:
    cards = c.get("/v1/models").json()["data"]
    return next(card["state"] for card in cards if card["id"] == model)


def wait_state(c: httpx.Client, model: str, wanted: str) -> None:
    deadline = time.monotonic() + 300
    while state(c, model) != wanted:
        if time.monotonic() > deadline:
            raise SystemExit(f"{model} never became {wanted}")
        time.sleep(0.05)


def ttft(c: httpx.Client, model: str, keep_alive: float) -> float:
    """Seconds to the first content of a streamed chat answer from ``model``."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
            "stream": True, "keep_alive": keep_alive}
    start = time.perf_counter()
    first = None
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - start
    assert first is not None
    return first


def stream_a(url: str, a: str, b: str, tokens: int, load: bool) -> tuple[list[float], float | None, int]:
    """A's gaps (seconds) after its SKIP-th token (with ``load``: until B's first
    token), B's TTFT if it was asked, and A's tokens in that window."""
    arrivals: list[float] = []
    b_sent = threading.Event()
    b_first: list[float] = []

    def ask_b() -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            t0 = time.perf_counter()
            b_first.append(t0)
            b_first.append(t0 + ttft(c, b, keep_alive=0))

    body = {"model": a, "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "keep_alive": -1}
    helper = None
    with httpx.Client(base_url=url, timeout=600) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                arrivals.append(time.perf_counter())
                if load and len(arrivals) == SKIP and not b_sent.is_set():
                    b_sent.set()
                    helper = threading.Thread(target=ask_b)
                    helper.start()
    if helper is not None:
        helper.join()
    end = b_first[1] if load else arrivals[-1]
    window = [t for t in arrivals[SKIP - 1:] if t <= end]
    gaps = [y - x for x, y in itertools.pairwise(window)]
    b_ttft = b_first[1] - b_first[0] if load else None
    if load and end > arrivals[-1]:
        print(f"  (A's stream ended {end - arrivals[-1]:.2f} s before B's first token: raise --tokens)")
    return gaps, b_ttft, len(window) - 1


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random", help="random | default | DIR (default: random)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=300, help="A's streamed tokens per run")
    parser.add_argument("--no-warmup", action="store_true", help="serve with afm serve --no-warmup")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="afm-many-"))
    if args.model == "random":
        from afm_core.testing import make_random_model

        a_dir = make_random_model(work / "model-a", seed=1)
        b_dir = make_random_model(work / "model-b", seed=2)
    else:
        src = model_path(args.model, work)
        a_dir = work / "model-a"
        b_dir = work / "model-b"
        a_dir.symlink_to(src.resolve(), target_is_directory=True)
        b_dir.symlink_to(src.resolve(), target_is_directory=True)
    server = Server([a_dir, b_dir], ["--no-warmup"] if args.no_warmup else [])
    a, b = "model-a", "model-b"
    quiet_gaps: list[float] = []
    load_gaps: list[float] = []
    during: list[int] = []
    cold: list[float] = []
    warm: list[float] = []
    try:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            ttft(c, a, keep_alive=-1)  # A loaded (and warm) from here on
            for rnd in range(args.rounds):
                for load in ((True, False) if rnd % 2 == 0 else (False, True)):
                    wait_state(c, b, "unloaded")
                    gaps, b_ttft, n = stream_a(server.url, a, b, args.tokens, load)
                    (load_gaps if load else quiet_gaps).extend(gaps)
                    if load:
                        during.append(n)
                        assert b_ttft is not None
                        print(f"round {rnd + 1}: B loaded in {b_ttft:.2f} s (first token); "
                              f"A gave {n} tokens meanwhile, max gap {max(gaps) * 1e3:.1f} ms")
                wait_state(c, b, "unloaded")
                cold.append(ttft(c, b, keep_alive=-1))
                warm.append(ttft(c, b, keep_alive=0))
    finally:
        server.close()
    ms = 1e3
    print()
    print(f"model: {args.model}; {args.rounds} rounds; A streams {args.tokens} tokens per run"
          + ("; --no-warmup" if args.no_warmup else ""))
    print(f"B's TTFT, unloaded (its load included):        median {statistics.median(cold):.3f} s "
          f"(range {min(cold):.3f}-{max(cold):.3f})")
    print(f"B's TTFT, loaded:                             median {statistics.median(warm) * ms:.1f} ms "
          f"(range {min(warm) * ms:.1f}-{max(warm) * ms:.1f})")
    print("A's inter-token gaps            p50        p90        max     tokens")
    print(f"  while B loads            {pct(load_gaps, .5) * ms:8.2f} ms {pct(load_gaps, .9) * ms:8.2f} ms "
          f"{max(load_gaps) * ms:8.2f} ms {len(load_gaps):6d}")
    print(f"  nothing else running     {pct(quiet_gaps, .5) * ms:8.2f} ms {pct(quiet_gaps, .9) * ms:8.2f} ms "
          f"{max(quiet_gaps) * ms:8.2f} ms {len(quiet_gaps):6d}")
    print(f"A's tokens while B loaded, per round: {during}")


if __name__ == "__main__":
    main()
