"""When a dispatcher uses a Cython accelerator, and what a failed import says.

Each dispatcher (``detok``, ``reasoning``, ``tools``, ``sse``, ``pipeline``,
``accumulate``) imports its compiled module explicitly, as yarl's
``_quoting.py`` does (``detok.py`` shows the pattern): ``from . import
X_c`` unless ``NO_EXTENSIONS``; on ``ImportError``, :func:`build_unusable`
and ``from . import X_py``; ``COMPILED`` says which one runs.

A stub ``X_c.pyi`` beside each compiled module types it, so mypy checks the
dispatchers' callers against it (it mirrors the pure twin's API;
``tests/stream/test_twins.py`` compares the two).  The module is imported as
``from . import X_c`` rather than ``from .X_c import ...`` because
import-linter, which sees no source for a compiled module, would otherwise
count it as an import of ``afm_core`` itself.

``AFM_NO_EXTENSIONS=1`` forces the pure twins (the same variable makes
``setup.py`` skip the build).  A build that is absent (no file) falls back
quietly; one that exists but does not import (stale or corrupt) is logged as
a warning naming the module and the error, then falls back.
``tests/stream/test_twins.py`` checks that the compiled build is what loads
by default, so a missing build fails the tests rather than slowing the server.
"""

from __future__ import annotations

import importlib.util
import logging
import os

__all__ = ["NO_EXTENSIONS", "build_unusable"]

NO_EXTENSIONS: bool = os.environ.get("AFM_NO_EXTENSIONS", "") not in ("", "0")

log = logging.getLogger("afm.stream")


def build_unusable(module: str, exc: ImportError) -> None:
    """Importing ``module`` (``afm_core._stream.X_c``) raised ``exc``.

    Quiet when there is no such module (not built); otherwise a warning,
    since the pure twin ``X_py`` now runs in its place.
    """
    if importlib.util.find_spec(module) is None:
        return
    log.warning(
        "%s exists but does not import (%s: %s); using the pure-Python twin %s_py",
        module,
        type(exc).__name__,
        exc,
        module.removesuffix("_c"),
    )
