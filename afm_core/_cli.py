"""The ``afm`` console script: the one entry point, dispatching to each package's subcommands.

Subcommands are registered as entry points in the ``afm.commands`` group
(``pyproject.toml``), so a package adds its own without this module naming
it, and ``afm_core`` never imports the HTTP layer.  Each entry point names a
module with ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``; only the chosen subcommand's module is imported, so
``afm testing make-model`` never imports the HTTP stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

GROUP = "afm.commands"

# One-line help per known subcommand, so ``afm --help`` imports none of them.
_HELP: dict[str, str] = {
    "serve": "start the OpenAI-compatible HTTP server",
    "testing": "offline test models (make-model)",
    "convert-gguf": "convert a llama GGUF file to an mlx-lm directory",
    "fetch-default": "fetch and convert the embedded default model",
    "models": "list the models Ollama, LM Studio and the Hugging Face cache hold locally",
    "bench": "benchmark a served model against raw mlx-lm and peers",
    "deploy": "write the configuration that runs afm replicas behind a balancer (haproxy)",
}


def subcommands() -> dict[str, str]:
    """Subcommand name -> module, from the ``afm.commands`` entry points."""
    return dict(sorted((ep.name, ep.value) for ep in entry_points(group=GROUP)))


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the ``selected`` subcommand's module is imported."""
    parser = argparse.ArgumentParser(prog="afm", description="afm: local AI inference on MLX")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    commands = subcommands()
    if not commands:
        parser.error(f"no subcommands: the afm distribution is not installed (no '{GROUP}' "
                     "entry points); run `make install` or `pip install -e .`")
    for name, module in commands.items():
        help_text = _HELP.get(name, f"the {name} subcommand ({module})")
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
        hint = " (install the 'afm[http]' extra)" if args.command == "serve" else ""
        parser.error(f"'{args.command}' is unavailable: {err}{hint}")
    mod = importlib.import_module(args._module)
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
