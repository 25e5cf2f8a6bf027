"""Model architectures afm adds to mlx-lm.

mlx-lm resolves ``config.json``'s ``model_type`` by importing
``mlx_lm.models.<model_type>``; registering a module under that name makes the
type loadable by ``mlx_lm.load`` and our engine alike, with no special case in
either.  Importing ``afm_core`` calls :func:`register`.
"""

from __future__ import annotations

import importlib
import sys

ARCHITECTURES: dict[str, str] = {
    "afm_echo": "afm_core.testing._echo",
}


def register() -> None:
    for model_type, module in ARCHITECTURES.items():
        name = f"mlx_lm.models.{model_type}"
        if name not in sys.modules:
            sys.modules[name] = _LazyModule(name, module)  # type: ignore[assignment]


class _LazyModule:
    """Stands in for the module until mlx-lm asks for ``Model``/``ModelArgs``."""

    def __init__(self, name: str, target: str):
        self.__name__ = name
        self._target = target

    def __getattr__(self, attr: str) -> object:
        return getattr(importlib.import_module(self._target), attr)
