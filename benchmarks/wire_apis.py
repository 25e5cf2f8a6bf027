"""Per-token cost of each wire API's translation, next to a decode step.

Run: ``.venv/bin/python benchmarks/wire_apis.py [--tokens 2000] [--repeat 7]``

``afm bench --api X`` measures the served ratio end to end, where machine noise
(±15 % between rounds here) hides a difference of a few percent.  This script
isolates what differs between the APIs: the sans-IO translation of the same
engine events into each API's bytes, through the one writer interface the HTTP
driver calls (``Writer.start``, ``Writer.feed(0, batch)`` per engine step,
``Writer.end``; :mod:`afm_core.api.writer`), so it counts all the per-step
work a route does (chat's ``encoder`` row is the Cython ``SSEEncoder`` alone,
the floor under chat's writer; ``ollama`` is ``/api/chat``'s NDJSON lines).  The events are one streamed answer, one ``ContentDelta`` per
engine step (the C=1 case, the worst for per-step overhead), as the engine
emits them.  Each API is timed on the whole stream (best of ``--repeat``) and
reported in µs per token, with its share of one decode step of the default
model (``--step-ms``, 50 ms ≈ 20 tok/s here; the tiny test models step in
~1 ms, so they are also shown).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from afm_core import ContentDelta, Finish, SSEEncoder, Usage
from afm_core.api import anthropic, chat, completions, ollama, responses
from afm_core.api.writer import Writer

WORDS = ("Local", " inference", " keeps", " your", " data", " on", " your", " machine", ".",
         " The", " engine", " streams", " each", " token", " as", " soon", " as", " it", " is", " sampled")


def steps(tokens: int) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [(ContentDelta(WORDS[i % len(WORDS)]),) for i in range(tokens)]
    out.append((Finish("stop"), Usage(40, tokens, 0)))
    return out


def encoder(batches: Sequence[tuple[Any, ...]]) -> int:
    enc = SSEEncoder("chatcmpl-1", 1, "m")
    n = sum(len(enc.encode_many(b)) for b in batches)
    return n + len(enc.done())


def run(writer: Writer, batches: Sequence[tuple[Any, ...]]) -> int:
    n = len(writer.start())
    n += sum(len(writer.feed(0, b)) for b in batches)
    return n + len(writer.end())


def chat_writer(batches: Sequence[tuple[Any, ...]]) -> int:
    return run(chat.Writer(id="chatcmpl-1", created=1, model="m", include_usage=True), batches)


def legacy(batches: Sequence[tuple[Any, ...]]) -> int:
    call = completions.parse({"model": "m", "prompt": "x", "stream": True,
                              "stream_options": {"include_usage": True}})
    return run(completions.Writer(call, id="cmpl-1", created=1, model="m"), batches)


def messages(batches: Sequence[tuple[Any, ...]]) -> int:
    return run(anthropic.Writer(anthropic.MessageStream(model="m", input_tokens=40)), batches)


def resp(batches: Sequence[tuple[Any, ...]]) -> int:
    call = responses.parse({"model": "m", "input": "x", "stream": True, "store": False})
    return run(responses.Writer(responses.ResponseWriter(call, id="resp_1", created_at=1.0, model="m")),
               batches)


def ollama_chat(batches: Sequence[tuple[Any, ...]]) -> int:
    return run(ollama.Writer(model="m"), batches)


APIS: dict[str, Callable[[Sequence[tuple[Any, ...]]], int]] = {
    "encoder": encoder, "chat": chat_writer, "completions": legacy, "messages": messages,
    "responses": resp, "ollama": ollama_chat}


def elapsed_ns(fn: Callable[[], Any]) -> float:
    start = time.perf_counter_ns()
    fn()
    return float(time.perf_counter_ns() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--step-ms", type=float, default=50.0, help="a decode step of the default model")
    args = parser.parse_args()
    batches = steps(args.tokens)
    # interleaved: each round times every API once
    rounds: dict[str, list[float]] = {name: [] for name in APIS}
    for _ in range(args.repeat):
        for name, fn in APIS.items():
            rounds[name].append(elapsed_ns(lambda fn=fn: fn(batches)))
    base = min(rounds["chat"]) / args.tokens
    step = f"% of {args.step_ms:g}ms step"
    print(f"{'api':<12} {'us/token':>9} {'vs chat':>8} {step:>15} {'% of 1ms step':>14} {'bytes':>8}")
    for name, fn in APIS.items():
        ns = min(rounds[name]) / args.tokens
        print(f"{name:<12} {ns / 1000:>9.2f} {ns / base:>7.2f}x {100 * ns / (args.step_ms * 1e6):>14.3f}% "
              f"{100 * ns / 1e6:>13.2f}% {fn(batches):>8}")


if __name__ == "__main__":
    main()
