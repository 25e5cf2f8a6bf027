"""Per-token cost of the sans-IO stream core, Cython (c) vs pure (py) twins.

Run: ``.venv/bin/python benchmarks/stream_core.py [--repeat 5]``

Streams (offline byte-level BPE from ``tests/stream/tokenizers.py``): English
prose, CJK text, and a tool call whose JSON argument string is ~5k tokens.
Each component is timed on the whole stream (best of ``--repeat``) and
reported in ns per token; ``chain`` is detokenize + reasoning + encode, the
per-token path of a streamed response.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from afm_core._stream.detok_tables import DecoderTables
from afm_core._stream.events import ToolCallDelta
from afm_core._stream.toolcalls.registry import make_tool_tracker
from tests.stream import tokenizers as stream_tokenizers

TWINS = ("c", "py")


def twin(component: str, which: str) -> Any:
    return importlib.import_module(f"afm_core._stream.{component}_{which}")


def streams(tok: Any) -> dict[str, list[int]]:
    prose = (
        "Local inference keeps your data on your machine. The engine streams each token as "
        "soon as it is sampled, and the server turns it into an event the client can show. "
    ) * 60
    cjk = "今天天气很好，我们去公园散步吧。中文分词是一个有趣的问题。東京は日本の首都です。" * 600
    args = json.dumps(
        {"path": "notes/meeting.md", "content": [{"line": i, "text": f"item {i}: ship the build"} for i in range(420)]}
    )
    return {
        "prose": tok.encode("<think>Let me think. " + prose[:2000] + "</think>" + prose).ids,
        "cjk": tok.encode(cjk).ids,
        "json-5k": tok.encode(args).ids[:5000],
    }


def best(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return float(min(times))


def bench_stream(name: str, ids: list[int], tables: DecoderTables, repeat: int) -> list[tuple[str, str, float, float]]:
    rows: list[tuple[str, str, float, float]] = []
    py_detok = twin("detok", "py").IncrementalDetokenizer(tables)
    texts = [py_detok.feed(i) for i in ids]
    is_json = name.startswith("json")
    splitter = twin("reasoning", "py").ReasoningSplitter()
    events_per_token = [splitter.feed(t) for t in texts]
    tool_events = [[ToolCallDelta(0, t)] for t in texts]
    n = len(ids)
    results: dict[str, dict[str, float]] = {}
    for which in TWINS:
        detok_mod, reason_mod, sse_mod, acc_mod = (
            twin(c, which) for c in ("detok", "reasoning", "sse", "accumulate")
        )
        r: dict[str, float] = {}

        # the closures run within this iteration; defaults bind this twin's modules
        def detok(detok_mod: Any = detok_mod) -> None:
            d = detok_mod.IncrementalDetokenizer(tables)
            feed = d.feed
            for i in ids:
                feed(i)
            d.flush()

        def reasoning(reason_mod: Any = reason_mod) -> None:
            s = reason_mod.ReasoningSplitter()
            feed = s.feed
            for t in texts:
                feed(t)
            s.flush()

        def encode(sse_mod: Any = sse_mod) -> None:
            e = sse_mod.SSEEncoder("chatcmpl-bench", 1700000000, "afm/bench")
            enc = e.encode_many
            for evs in tool_events if is_json else events_per_token:
                enc(evs)

        def chain(detok_mod: Any = detok_mod, reason_mod: Any = reason_mod,
                  sse_mod: Any = sse_mod) -> None:
            d = detok_mod.IncrementalDetokenizer(tables)
            s = reason_mod.ReasoningSplitter()
            e = sse_mod.SSEEncoder("chatcmpl-bench", 1700000000, "afm/bench")
            feed, split, enc = d.feed, s.feed, e.encode_many
            for i in ids:
                enc(split(feed(i)))
            enc(s.flush())

        tools_mod = twin("tools", which)

        pipe_mod = twin("pipeline", which)

        def full(detok_mod: Any = detok_mod, reason_mod: Any = reason_mod, sse_mod: Any = sse_mod,
                 tools_mod: Any = tools_mod, pipe_mod: Any = pipe_mod) -> None:
            # the engine's whole per-token chain (StreamPipeline: detok -> reasoning ->
            # tool tracker) plus encode; the JSON stream is the arguments of one Hermes call
            t = make_tool_tracker("hermes", impl=tools_mod)
            pipe = pipe_mod.StreamPipeline(detok_mod.IncrementalDetokenizer(tables),
                                           reasoning=reason_mod.ReasoningSplitter(), tools=t)
            e = sse_mod.SSEEncoder("chatcmpl-bench", 1700000000, "afm/bench")
            feed, enc = pipe.feed_token, e.encode_many
            if is_json:
                enc(t.feed('<tool_call>{"name": "write", "arguments": '))
            for i in ids:
                out: list[Any] = []
                feed(i, out)
                enc(out)
            out = []
            pipe.finish(out)
            enc(out)

        frames = [twin("sse", "py").SSEEncoder("chatcmpl-bench", 1, "m").encode_many(ev) for ev in tool_events]

        def accumulate(acc_mod: Any = acc_mod, frames: list[bytes] = frames) -> None:
            a = acc_mod.ChunkAccumulator()
            feed = a.feed_bytes
            for f in frames:
                feed(f)
            feed(b"data: [DONE]\n\n")
            a.result()

        for label, fn in (("detok", detok), ("reasoning", reasoning), ("encode", encode), ("chain", chain), ("full", full), ("accumulate", accumulate)):
            r[label] = best(fn, repeat) / n
        results[which] = r
    for label in results["c"]:
        rows.append((label, name, results["c"][label], results["py"][label]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    tok = stream_tokenizers.byte_level(2000)
    tables = DecoderTables.from_tokenizer(tok)
    rows = []
    for name, ids in streams(tok).items():
        print(f"{name}: {len(ids)} tokens", file=sys.stderr)
        rows.extend(bench_stream(name, ids, tables, args.repeat))
    print(f"{'component':<11} {'stream':<8} {'c ns/tok':>9} {'py ns/tok':>10} {'speedup':>8}")
    for label, name, c, py in rows:
        print(f"{label:<11} {name:<8} {c:>9.0f} {py:>10.0f} {py / c:>7.1f}x")


if __name__ == "__main__":
    main()
