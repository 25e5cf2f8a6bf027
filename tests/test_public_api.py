"""afm_core's curated public face."""

from __future__ import annotations

import subprocess
import sys
import types

import afm_core


def test_exported_names() -> None:
    public = {
        n for n in dir(afm_core)
        if not n.startswith("_") and not isinstance(getattr(afm_core, n), types.ModuleType)
    } - {"annotations"}
    assert public | {"__version__"} == set(afm_core.__all__)
    for name in afm_core.__all__:
        assert getattr(afm_core, name) is not None


def test_import_without_http_stack() -> None:
    code = (
        "import sys, afm_core; "
        "bad = [m for m in ('quart', 'quart_trio', 'hypercorn', 'afm_http') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
