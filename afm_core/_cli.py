"""The ``afm`` console script.

Subcommands live in their own modules and are imported only when used, so
``afm testing make-model`` never imports the HTTP stack.  Each module
provides ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("afm_http._serve_cli", "start the OpenAI-compatible HTTP server"),
    "testing": ("afm_core.testing._cli", "offline test models (make-model)"),
    "convert-gguf": ("afm_core._models.gguf.cli", "convert a llama GGUF file to an mlx-lm directory"),
    "fetch-default": ("afm_core._models.default_model_cli", "fetch and convert the embedded default model"),
    "bench": ("afm_core.bench._cli", "benchmark a served model against raw mlx-lm and peers"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the ``selected`` subcommand's module is imported."""
    parser = argparse.ArgumentParser(prog="afm", description="afm: local AI inference on MLX")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module)
        if name != selected:
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            sp.set_defaults(_import_error=exc)
            continue
        mod.add_arguments(sp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(selected)
    args = parser.parse_args(argv)
    err = getattr(args, "_import_error", None)
    if err is not None:
        hint = " (install the 'afm[http]' extra)" if args._module.startswith("afm_http") else ""
        parser.error(f"'{args.command}' is unavailable: {err}{hint}")
    mod = importlib.import_module(args._module)
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
