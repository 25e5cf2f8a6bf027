"""``afm fetch-default``: fetch and convert the embedded default model, print its directory."""

from __future__ import annotations

import argparse
import sys
import time

from .._errors import AFMError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", help="cache root (default: $AFM_HOME or ~/.cache/afm)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--dequantize", dest="dequantize", action="store_true", default=None,
        help="write float32 weights (the default on CPU)",
    )  # fmt: skip
    group.add_argument(
        "--quantized", dest="dequantize", action="store_false",
        help="keep the Q4_1/Q8_0 weights MLX-quantized (float32 scales)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from .default_model import DEFAULT_MODEL_NAME, ensure_default_model

    start = time.monotonic()
    try:
        out = ensure_default_model(args.home, dequantize=args.dequantize)
    except AFMError as exc:
        print(f"afm fetch-default: error: {exc.message}", file=sys.stderr)
        return 1
    print(
        f"afm: default model {DEFAULT_MODEL_NAME} ready ({time.monotonic() - start:.1f}s)",
        file=sys.stderr,
    )
    print(out)
    return 0
