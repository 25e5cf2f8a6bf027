"""A switch back to mlx-lm's own operations for the calling thread.

afm routes mlx-lm's ``scaled_dot_product_attention`` and ``swiglu`` through
its CPU kernels by rebinding those names in mlx-lm's model modules
(:mod:`.attention`, :mod:`.activations`): every model of that architecture
in the process then takes the kernels.  The attention kernels have no
gradients, so code that trains a model of the same architecture in the same
process (a LoRA adapter, say) does it inside :func:`mlx_lm_operations`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["kernels_allowed", "mlx_lm_operations"]

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
