"""``afm convert-gguf FILE OUT_DIR``: convert a GGUF file (llama, qwen2/3, gemma2/3, phi3, ...)
to an mlx-lm directory."""

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
        help="write quantized tensors as float weights (llama.cpp's dequantized values) "
        "instead of MLX quantized ones",
    )
    parser.add_argument(
        "--scale-dtype",
        choices=("float16", "float32", "bfloat16"),
        default=None,
        help="float type of the quantized layers' scales and biases (default: float16; the "
        "embedding's stay float32)",
    )
    parser.add_argument(
        "--q6k-bits",
        type=int,
        choices=(6, 8),
        default=8,
        help="MLX bit width of Q6_K tensors (default 8: one sub-block of each 32 exact, the other "
        "within a quarter step; 6: smaller, within a whole step)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="float type of float weights and norms (default: float32, fastest on CPU)",
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
            q6k_bits=args.q6k_bits,
            **({"scale_dtype": args.scale_dtype} if args.scale_dtype else {}),
        )
    except AFMError as exc:
        print(f"afm convert-gguf: error: {exc.message}", file=sys.stderr)
        return 1
    say(f"done in {time.monotonic() - start:.1f}s")
    print(out)
    return 0
