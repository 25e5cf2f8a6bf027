"""Prefix-cache lookups: mlx-lm's ``PromptTrie`` against the engine's ``PrefixTrie``.

    .venv/bin/python benchmarks/prefix_cache.py [--entries 256] [--shared 22] [--lookups 200]

Fills both tries with ``--entries`` token sequences that share their first
``--shared`` tokens (a chat template's start) and go on with 60-200 random
tokens, as the engine's cache holds them after serving that many chats, then
times ``search`` for new prompts that share the same start (the lookup the
engine makes for every request it admits).  Both must find a stored sequence
of the same length, which is checked.
"""

from __future__ import annotations

import argparse
import random
import time

import afm_core  # noqa: F401  (first: binds MLX's BLAS, see afm_core._mlx.blas)

# isort: split
from mlx_lm.models.cache import PromptTrie

from afm_core._mlx.prefix_cache import PrefixTrie


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=256)
    ap.add_argument("--shared", type=int, default=22)
    ap.add_argument("--lookups", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(0)
    start = [rng.randrange(1000) for _ in range(args.shared)]
    stored = [start + [rng.randrange(1000) for _ in range(rng.randrange(60, 200))] for _ in range(args.entries)]
    prompts = [start + [rng.randrange(1000) for _ in range(100)] for _ in range(args.lookups)]
    found = {}
    print(f"{args.entries} entries sharing {args.shared} tokens, {args.lookups} lookups")
    for trie in (PromptTrie(), PrefixTrie()):
        for seq in stored:
            trie.add("m", seq, None)
        t0 = time.perf_counter()
        results = [trie.search("m", p) for p in prompts]
        dt = (time.perf_counter() - t0) / len(prompts)
        found[type(trie).__name__] = [len(r.longer or []) for r in results]
        print(f"  {type(trie).__name__:>10}: {dt * 1e6:8.0f} us per lookup")
    if found["PromptTrie"] != found["PrefixTrie"]:
        raise SystemExit("the tries found different lengths")


if __name__ == "__main__":
    main()
