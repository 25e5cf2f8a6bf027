"""afm's kernels in mlx-lm's modules (:class:`ModuleRebinding`), and a switch
back to mlx-lm's own operations for the calling thread.

afm routes mlx-lm's ``scaled_dot_product_attention`` and ``swiglu`` through
its CPU kernels by rebinding those names in mlx-lm's model modules
(:mod:`.attention`, :mod:`.activations`): every model of that architecture
in the process then takes the kernels.  The attention kernels have no
gradients, so code that trains a model of the same architecture in the same
process (a LoRA adapter, say) does it inside :func:`mlx_lm_operations`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import mlx.nn as nn

__all__ = ["ModuleRebinding", "kernels_allowed", "mlx_lm_operations"]

_local = threading.local()


def kernels_allowed() -> bool:
    """False inside :func:`mlx_lm_operations` on this thread."""
    return not getattr(_local, "depth", 0)


@contextmanager
def mlx_lm_operations() -> Iterator[None]:
    """Within the block, this thread's models compute with mlx-lm's own
    attention and SwiGLU (differentiable), whatever other models rebound."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


class ModuleRebinding:
    """One of mlx-lm's module-level names (``swiglu``,
    ``scaled_dot_product_attention``) pointed at afm's wrapper in the modules
    a model's layers come from, counted per module: the last model to
    :meth:`restore` gives the module mlx-lm's function back."""

    def __init__(self, name: str, original: Callable[..., Any], replacement: Callable[..., Any],
                 tag: str) -> None:
        self.name = name
        self.original = original
        self.replacement = replacement
        self.tag = tag  # the model attribute listing the modules it rebound
        self.users: dict[str, int] = {}  # module name -> models using the replacement there
        self._lock = threading.Lock()

    def modules(self, model: nn.Module) -> list[ModuleType]:
        """The modules of ``model``'s layers that import the name (either binding)."""
        names = {type(layer).__module__ for _, layer in model.named_modules()}
        found = []
        for name in sorted(names):
            module = sys.modules.get(name)
            if module is not None and getattr(module, self.name, None) in (self.original, self.replacement):
                found.append(module)
        return found

    def use(self, model: nn.Module) -> int:
        """Point the name at the replacement in ``model``'s modules; how many."""
        modules = self.modules(model)
        with self._lock:
            for module in modules:
                setattr(module, self.name, self.replacement)
                self.users[module.__name__] = self.users.get(module.__name__, 0) + 1
        object.__setattr__(model, self.tag, tuple(m.__name__ for m in modules))
        return len(modules)

    def restore(self, model: nn.Module) -> int:
        """Undo :meth:`use` for ``model``; a module gets the original back when
        no other model uses the replacement there."""
        names: tuple[str, ...] = getattr(model, self.tag, ())
        if not names:
            return 0
        object.__delattr__(model, self.tag)
        with self._lock:
            for name in names:
                left = self.users.get(name, 0) - 1
                if left > 0:
                    self.users[name] = left
                    continue
                self.users.pop(name, None)
                module = sys.modules.get(name)
                if module is not None and getattr(module, self.name, None) is self.replacement:
                    setattr(module, self.name, self.original)
        return len(names)
