"""Import mlx-lm without letting it lower the process's open-file limit.

``mlx_lm.utils`` sets ``RLIMIT_NOFILE`` to ``(2048, 4096)`` when it is first
imported ("for large models with lots of files"): that lowers the hard limit
of a process that had more (for good: an unprivileged process cannot raise it
back), so a server could never keep more than about 4,000 sockets, and it
fails outright (``ValueError``, the import crashes) where the hard limit is
below 4096.  :func:`import_mlx_lm` imports it once with ``setrlimit`` made to
only ever raise the soft limit (to 2048, as mlx-lm wants, where the hard limit
allows), leaving the hard limit alone; ``import afm_core`` calls it before
anything else imports mlx-lm.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_mlx_lm"]


def import_mlx_lm() -> None:
    """Import ``mlx_lm.utils`` keeping the open-file limit as high as it was."""
    try:
        import resource
    except ImportError:  # (not on a POSIX system: nothing to keep)
        importlib.import_module("mlx_lm.utils")
        return
    real = resource.setrlimit

    def only_raise(which: int, limits: Any) -> None:
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)
            return
        soft, hard = resource.getrlimit(which)
        wanted = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
        if wanted > soft:
            real(which, (wanted, hard))

    resource.setrlimit = only_raise  # type: ignore[assignment]
    try:
        importlib.import_module("mlx_lm.utils")
    finally:
        resource.setrlimit = real  # type: ignore[assignment]
