"""The GGUF architectures afm converts, one module per family.

:data:`ARCHITECTURES` maps a GGUF ``general.architecture`` to the
:class:`~.base.Architecture` that converts it onto an mlx-lm model class.
"""

from __future__ import annotations

from ...._errors import GGUFError
from .base import Architecture, Hparams
from .gemma import Gemma2, Gemma3
from .llama import Llama
from .phi3 import Phi3
from .qwen import Qwen2, Qwen3, Qwen3Moe

__all__ = ["ARCHITECTURES", "Architecture", "Hparams", "get_architecture"]

ARCHITECTURES: dict[str, Architecture] = {
    a.gguf_name: a for a in (Llama(), Qwen2(), Qwen3(), Qwen3Moe(), Gemma2(), Gemma3(), Phi3())
}


def get_architecture(name: str | None, path: str = "") -> Architecture:
    """The converter of GGUF architecture ``name``, or :class:`GGUFError`."""
    arch = ARCHITECTURES.get(name or "")
    if arch is None:
        where = f"{path}: " if path else ""
        raise GGUFError(
            f"{where}unsupported GGUF architecture {name!r} "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return arch
