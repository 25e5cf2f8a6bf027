"""Single-stream decode speed as a user sees it: ``afm serve`` in a fresh
process per setting, the ``openai`` SDK streaming one answer.

    .venv/bin/python benchmarks/decode_served.py [--model DIR] [--env AFM_BLAS_GEMV=off --env AFM_BLAS_GEMV=auto] [--rounds 3]

For each ``--env`` setting (``NAME=VALUE``, or several separated by spaces
in one argument; repeatable; each one is a server of its own; none: the
defaults), a server starts on a free port, serves one
warm-up answer, then ``--rounds`` streamed answers to "Write three sentences
about Paris." (greedy, ``--max-tokens`` 128, ``ignore_eos`` so every answer
is equally long).  Decode tok/s is (the usage's completion tokens - 1) /
(last text - first text); TTFT is the first text's wait.  The settings alternate round by
round (A B, B A, ...), so machine noise hits them alike; the table shows
each one's median and range.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

QUESTION = "Write three sentences about Paris."


class Server:
    def __init__(self, model: str | None, env: dict[str, str]) -> None:
        argv = [sys.executable, "-m", "afm_core._cli", "serve", "--port", "0", "--quiet"]
        if model:
            argv += ["--model", model]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 600
        self.url = ""
        for line in self.proc.stderr:
            if m := re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line):
                self.url = m.group(1)
                break
            if time.monotonic() > deadline:
                break
        if not self.url:
            self.proc.kill()
            raise SystemExit(f"afm serve did not start with {env}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def one_answer(url: str, max_tokens: int) -> tuple[float, float]:
    """(decode tok/s, TTFT seconds) of one streamed answer."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    start = time.perf_counter()
    stamps = []
    stream = client.completions.create(model="m", prompt=QUESTION, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    tokens = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    client.close()
    if len(stamps) < 2 or tokens < 2:
        raise SystemExit("the answer had fewer than two tokens")
    # every token after the first, over the time from the first text to the last
    # (a token whose text is held back, or has none, still counts: usage says how many)
    return (tokens - 1) / (stamps[-1] - stamps[0]), stamps[0] - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="served model (default: afm's default model)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="one setting per server (repeatable); none: the defaults")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    settings = [dict(item.split("=", 1) for item in e.split()) for e in args.env] or [{}]
    servers = [Server(args.model, env) for env in settings]
    results: list[dict[str, list[float]]] = [{"tok_s": [], "ttft": []} for _ in settings]
    try:
        for s in servers:
            one_answer(s.url, 16)  # warm-up
        for r in range(args.rounds):
            order = range(len(servers)) if r % 2 == 0 else reversed(range(len(servers)))
            for i in order:
                rate, ttft = one_answer(servers[i].url, args.max_tokens)
                results[i]["tok_s"].append(rate)
                results[i]["ttft"].append(ttft)
    finally:
        for s in servers:
            s.close()
    print(f"model: {args.model or 'default'}; {args.rounds} rounds of {args.max_tokens} tokens; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'setting':<28} {'decode tok/s (median, range)':<32} {'TTFT ms (median)':>16}")
    for env, res in zip(settings, results, strict=True):
        name = " ".join(f"{k}={v}" for k, v in env.items()) or "defaults"
        tok: Any = res["tok_s"]
        print(f"{name:<28} {statistics.median(tok):>7.1f}  [{min(tok):.1f}-{max(tok):.1f}]"
              f"{'':<14} {1000 * statistics.median(res['ttft']):>14.0f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
