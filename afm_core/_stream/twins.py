"""Choose between a Cython accelerator and its pure-Python twin.

``AFM_NO_EXTENSIONS=1`` forces the pure twins (the same variable makes
``setup.py`` skip the build).  Otherwise the compiled module is imported and
the twin is used only when the build is absent; ``tests/stream/test_twins.py``
checks that the compiled build is what loads by default, so a broken build
cannot fall back silently in CI.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

NO_EXTENSIONS: bool = os.environ.get("AFM_NO_EXTENSIONS", "") not in ("", "0")


def load_twin(c_module: str, py_module: str) -> ModuleType:
    """Import ``c_module`` unless disabled or missing, else ``py_module``.

    Both names are absolute (``afm_core._stream.detok_c``).
    """
    if not NO_EXTENSIONS:
        try:
            return importlib.import_module(c_module)
        except ImportError:
            pass
    return importlib.import_module(py_module)
