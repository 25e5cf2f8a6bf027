"""Tool-call fragment tracking per token, Cython (c) vs pure (py) twins.

Run: ``.venv/bin/python benchmarks/stream_tools.py [--repeat 5]``

Each format streams one call whose JSON argument string is ~5k tokens
(offline byte-level BPE from ``tests/stream/tokenizers.py``), token by token,
with some prose before it; a prose-only stream (no call) measures the cost
of watching content for a start tag.  The tracker for each run is built
fresh (``make_tool_tracker``) and timed on the whole stream, best of
``--repeat``, reported in ns per token.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from afm_core._stream.toolcalls.registry import make_tool_tracker
from tests.stream import tokenizers as stream_tokenizers

TWINS = ("c", "py")
TOOLS = [{"type": "function", "function": {"name": "write_notes", "parameters": {
    "type": "object",
    "properties": {"path": {"type": "string"}, "content": {"type": "array"}, "body": {"type": "string"}},
}}}]


def token_texts(tok: Any, text: str) -> list[str]:
    """``text`` as per-token strings (each token decoded on its own; fine for ASCII)."""
    ids = tok.encode(text).ids
    return [tok.decode([i]) for i in ids]


def streams(tok: Any) -> dict[str, tuple[str, list[str]]]:
    args = json.dumps({
        "path": "notes/meeting.md",
        "content": [{"line": i, "text": f"item {i}: ship the build"} for i in range(150)],
    })
    body = "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(300))
    prose = "Sure, I will write the notes now. " * 4
    hermes = prose + '<tool_call>\n{"name": "write_notes", "arguments": ' + args + "}\n</tool_call>"
    llama = '<|python_tag|>{"name": "write_notes", "parameters": ' + args + "}"
    mistral = prose + "[TOOL_CALLS]write_notes[ARGS]" + args
    qwen = (prose + "<tool_call>\n<function=write_notes>\n<parameter=path>\nnotes/meeting.md\n"
            "</parameter>\n<parameter=body>\n" + body + "\n</parameter>\n</function>\n</tool_call>")
    plain = "Local inference keeps your data on your machine; the engine streams tokens. " * 100
    return {
        "hermes": ("hermes", token_texts(tok, hermes)),
        "llama3": ("llama3_json", token_texts(tok, llama)),
        "mistral": ("mistral", token_texts(tok, mistral)),
        "qwen3xml": ("qwen3_coder", token_texts(tok, qwen)),
        "prose": ("hermes", token_texts(tok, plain)),
    }


def best(fmt: str, texts: list[str], which: str, repeat: int) -> float:
    mod = importlib.import_module(f"afm_core._stream.tools_{which}")
    times = []
    for _ in range(repeat):
        t = make_tool_tracker(fmt, tools=TOOLS, impl=mod)
        feed = t.feed
        start = time.perf_counter_ns()
        for text in texts:
            feed(text)
        t.flush()
        times.append(time.perf_counter_ns() - start)
        assert t.errors == [], t.errors
    return float(min(times)) / len(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    tok = stream_tokenizers.byte_level(2000)
    print(f"{'stream':<9} {'format':<12} {'tokens':>6} {'c ns/tok':>9} {'py ns/tok':>10} {'speedup':>8}")
    for name, (fmt, texts) in streams(tok).items():
        c, py = (best(fmt, texts, which, args.repeat) for which in TWINS)
        print(f"{name:<9} {fmt:<12} {len(texts):>6} {c:>9.0f} {py:>10.0f} {py / c:>7.1f}x")


if __name__ == "__main__":
    main()
