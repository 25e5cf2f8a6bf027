"""``afm convert-gguf FILE OUT_DIR``: convert a llama GGUF file to an mlx-lm directory."""

from __future__ import annotations

import argparse
import sys
import time

from ..._errors import AFMError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the .gguf file to convert")
    parser.add_argument("out_dir", help="the mlx-lm model directory to write")
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="write Q4_0/Q4_1/Q8_0 tensors as float weights instead of MLX quantized ones",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="float type of weights, norms and scales (default: float32, fastest on CPU)",
    )
    parser.add_argument(
        "--quantize",
        type=int,
        choices=(4, 8),
        default=None,
        help="write every linear and embedding weight MLX-quantized at 4 or 8 bits, group 32 "
        "(float tensors quantized, Q4/Q8 ones requantized)",
    )
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")


def run(args: argparse.Namespace) -> int:
    from .convert import convert_gguf, remove_partials

    def say(msg: str) -> None:
        print(f"afm: {msg}", file=sys.stderr, flush=True)

    start = time.monotonic()
    remove_partials(args.out_dir)  # leftovers of an earlier, killed run
    try:
        out = convert_gguf(
            args.file,
            args.out_dir,
            dequantize=args.dequantize,
            dtype=args.dtype,
            overwrite=args.force,
            progress=say,
            quantize=args.quantize,
        )
    except AFMError as exc:
        print(f"afm convert-gguf: error: {exc.message}", file=sys.stderr)
        return 1
    say(f"done in {time.monotonic() - start:.1f}s")
    print(out)
    return 0
