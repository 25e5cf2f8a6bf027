"""Decode speed of afm's quantized kernels against llama.cpp on the same GGUF.

    .venv/bin/python benchmarks/decode_llamacpp.py \\
        [--gguf ~/.cache/afm/downloads/real/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ...] \\
        [--isa default,avx2] [--act-bits 16] [--streams 1,8] [--tokens 128] [--rounds 4]

For each GGUF (default: the Qwen2.5-Coder 0.5B and 1.5B Q4_K_M files of issue
28), in one run: llama.cpp's server loop (``xllamacpp``, ``--threads`` threads,
8 parallel slots) on the file, and afm on the same weights as an mlx-lm
model (``_gguf_mlx.build``: dequantized with the ``gguf`` package and
requantized to MLX's 4-bit layout, group 32, float16 scales, until afm's own
converter reads qwen2 files) with the engine's CPU rewrite (``fuse_for_cpu``:
afm's kernels for every quantized product).  Both decode greedily after the
same prompt token ids (llama.cpp's tokenization of a chat prompt):

* 1 stream: ``--tokens`` tokens; afm times its decode steps, llama.cpp reports
  its own decode time (both without the prompt);
* 8 streams: 8 prompts decoded together, afm as one batch of 8 rows (every
  product an M=8 product), llama.cpp as 8 slots of its server loop; the
  aggregate decode rate (all tokens over the decode time).

afm runs once per ``--isa`` kernel set (``default``: the best this CPU runs;
``avx2``: what most x86 machines run) and ``--act-bits`` activation
precision, all in this process (``qmm_ext.set_isa``), llama.cpp in its own.
The variants take turns within each round, in reversed order every other
round; the table gives each variant's median and its median ratio to
llama.cpp over the rounds (each round's ratio from the same round), with
every round's ratio, since other processes move single runs a lot.  afm's
variants' greedy tokens are compared with the first variant's (agreement
in %: float rounding differs between kernel sets).  Beside the rates, each
side's CPU time per token (afm's process, llama.cpp's server process), a
measure of the work that other processes move less than the wall time
(though a thread spinning while it waits counts as work).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

# isort: split
import mlx.core as mx
from _gguf_mlx import build
from _llamacpp_peer import Peer, llama_server

from afm_core._mlx import qmatmul as _qmatmul
from afm_core.testing._real_gguf import real_gguf_path

GGUFS = [str(real_gguf_path("qwen2.5-coder-0.5b")), str(real_gguf_path("qwen2.5-coder-1.5b"))]
"""The real GGUFs where ``afm testing fetch-real NAME`` keeps them."""
QUESTIONS = [
    "Write a Python function that parses a CSV file and returns the rows as dictionaries.",
    "Explain the difference between a process and a thread, with an example in C.",
    "Write a bash script that renames every .jpeg file in a folder to .jpg.",
    "How does a hash map handle collisions? Answer with Java code.",
    "Write a SQL query that returns the ten customers with the largest total orders.",
    "Implement binary search in Rust and explain its complexity.",
    "Write a JavaScript debounce function and a test for it.",
    "What is a race condition? Show one in Go and fix it.",
]


def chat(question: str) -> str:
    return (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


class Afm:
    """The MLX model with afm's CPU kernels, decoding greedily."""

    def __init__(self, path: Path) -> None:
        from mlx_lm.utils import load_model

        from afm_core._mlx.fusion import fuse_for_cpu

        self.model, _ = load_model(path)
        fuse_for_cpu(self.model)

    def decode(self, prompts: list[list[int]], n: int) -> tuple[float, float, list[list[int]]]:
        """Aggregate decode tok/s of ``len(prompts)`` rows (equal lengths), the
        process's CPU seconds per token, and the tokens."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array(prompts), cache=cache)
        tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(tok)
        out = [tok]
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n - 1):
            tok = mx.argmax(self.model(tok, cache=cache)[:, -1:], axis=-1)
            mx.async_eval(tok)
            out.append(tok)
        mx.eval(tok)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = mx.concatenate(out, axis=1).tolist()
        count = len(prompts) * (n - 1)
        return count / dt, cpu / count, tokens


def variants(isas: list[str], act_bits: list[int]) -> list[tuple[str, str, int]]:
    ext = _qmatmul.extension()
    if ext is None:
        raise SystemExit("afm_core._mlx.qmm_ext is not built")
    best = ext.available_isas()[-1]
    out = []
    for isa in isas:
        name = best if isa == "default" else isa
        if name not in ext.available_isas():
            print(f"(skipping {isa}: this CPU does not run it)")
            continue
        out += [(f"afm {name} a{bits}", name, bits) for bits in act_bits]
    return out


def run_model(gguf: Path, args: argparse.Namespace) -> None:
    ext = _qmatmul.extension()
    assert ext is not None
    path = build(gguf, bits=args.bits, group=args.group, scales=args.scales)
    afm = Afm(path)
    ext.set_thread_limit(args.threads)
    vs = variants(args.isa.split(","), [int(b) for b in args.act_bits.split(",")])
    streams = [int(s) for s in args.streams.split(",")]
    with llama_server(gguf, args.threads, parallel=max(streams), ctx=max(streams) * 1024) as peer:
        prompts = [peer.tokenize(chat(q)) for q in QUESTIONS]
        length = min(len(p) for p in prompts)
        prompts = [p[:length] for p in prompts]  # one batch: equal lengths
        print(f"\n{gguf.name}: llama.cpp {args.threads} threads, {max(streams)} slots; afm "
              f"{path.name}, {min(args.threads, ext.num_threads())} kernel threads; prompt {length} tokens, "
              f"{args.tokens} new tokens per stream")
        for s in streams:
            table(peer, afm, vs, prompts[:s], args)


def table(peer: Peer, afm: Afm, vs: list[tuple[str, str, int]], prompts: list[list[int]],
          args: argparse.Namespace) -> None:
    ext = _qmatmul.extension()
    assert ext is not None
    names = ["llama.cpp"] + [v[0] for v in vs]
    rates: dict[str, list[float]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[list[int]]] = {}

    def one(name: str) -> tuple[float, float]:
        if name == "llama.cpp":
            if len(prompts) == 1:
                return peer.decode(prompts[0], args.tokens)[:2]
            return peer.decode_many(prompts, args.tokens)
        _, isa, bits = next(v for v in vs if v[0] == name)
        ext.set_isa(isa)
        ext.set_activation_bits(bits)
        rate, cpu, toks = afm.decode(prompts, args.tokens)
        tokens.setdefault(name, toks)
        return rate, cpu

    for name in names:  # warm-up
        one(name)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            rate, cpu = one(name)
            rates[name].append(rate)
            cpus[name].append(cpu)
        print(f"  round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names), flush=True)
    first = tokens.get(vs[0][0]) if vs else None
    print(f"  {len(prompts)} stream(s): decode tok/s (aggregate) and CPU ms per token, "
          f"median of {args.rounds} rounds; ratios to llama.cpp's in the same round (> 1: afm better)")
    print(f"  {'':<22} {'tok/s':>7} {'ratio':>6}  {'per round':<24} {'CPU ms/tok':>10} {'ratio':>6}  same tokens")
    for n in names:
        ratios = [a / b for a, b in zip(rates[n], rates["llama.cpp"], strict=True)]
        cpu_ratios = [b / a for a, b in zip(cpus[n], cpus["llama.cpp"], strict=True)]
        same = ""
        if first is not None and n in tokens:
            pairs = [(a, b) for x, y in zip(tokens[n], first, strict=True) for a, b in zip(x, y, strict=True)]
            same = f"{100 * sum(a == b for a, b in pairs) / len(pairs):5.1f}%"
        print(f"  {n:<22} {statistics.median(rates[n]):>7.2f} {statistics.median(ratios):>5.2f}x  "
              f"{' '.join(f'{x:.2f}' for x in ratios):<24} {1e3 * statistics.median(cpus[n]):>10.1f} "
              f"{statistics.median(cpu_ratios):>5.2f}x  {same}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", action="append", help="a qwen2 GGUF (repeat; default: the 0.5B and 1.5B)")
    ap.add_argument("--isa", default="default,avx2", help="afm kernel sets (comma list; default = the best)")
    ap.add_argument("--act-bits", default="16", help="afm activation precisions (comma list: 16, 8)")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2,
                    help="llama.cpp's threads, and afm's kernel threads per product")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--scales", default="float16")
    args = ap.parse_args()
    for g in args.gguf or GGUFS:
        run_model(Path(g), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
