"""afm_core: a Trio engine over MLX with a sans-IO streaming core."""

from __future__ import annotations

from . import _architectures

_architectures.register()

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]
