"""``afm models``: the models local stores hold (Ollama, LM Studio, the Hugging Face cache).

Each row is a name ``--model`` takes, its format (GGUF or MLX), quantization,
size on disk and architecture; ``--json`` prints the same (plus paths and
Ollama's params/template layers) as a JSON array.
"""

from __future__ import annotations

import argparse
import json
import sys

from .._errors import AFMError

HELP = "list the models Ollama, LM Studio and the Hugging Face cache hold locally"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", nargs="?", default=None,
                        help="one store's folder (e.g. ~/.ollama/models); default: every store "
                             "($OLLAMA_MODELS or ~/.ollama/models, ~/.lmstudio/models, "
                             "$HF_HUB_CACHE or ~/.cache/huggingface/hub)")
    parser.add_argument("--json", action="store_true", help="print a JSON array")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"  # pragma: no cover


def run(args: argparse.Namespace) -> int:
    from .stores import local_models

    try:
        models = local_models(args.root)
    except AFMError as exc:
        print(f"afm models: error: {exc.message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([m.as_json() for m in models], indent=2, ensure_ascii=False))
        return 0
    if not models:
        print("no local models found (Ollama, LM Studio, Hugging Face cache)", file=sys.stderr)
        return 0
    rows = [("NAME", "FORMAT", "QUANTIZATION", "SIZE", "ARCHITECTURE")]
    rows += [(m.name, m.format, m.quantization or "-", _size(m.size), m.architecture or "-") for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0
