"""Every accelerated module loads its Cython build by default, its pure twin on request.

Discovered from the tree: each ``afm_core/_stream/X_py.py`` with an ``ext/stream/X_c.pyx``
must have a dispatcher ``afm_core._stream.X`` re-exporting the twin's ``__all__``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def twins() -> list[str]:
    names = []
    for py in sorted((ROOT / "afm_core" / "_stream").glob("*_py.py")):
        stem = py.stem[: -len("_py")]
        if (ROOT / "ext" / "stream" / f"{stem}_c.pyx").exists():
            names.append(stem)
    return names


TWINS = twins()


def test_known_twins_are_discovered() -> None:
    assert {"detok", "reasoning", "sse", "accumulate", "tools", "pipeline"} <= set(TWINS)


def exported(stem: str) -> list[str]:
    return list(importlib.import_module(f"afm_core._stream.{stem}_py").__all__)


@pytest.mark.parametrize("stem", TWINS)
def test_cython_build_loads_by_default(stem: str) -> None:
    if os.environ.get("AFM_NO_EXTENSIONS", "") not in ("", "0"):
        pytest.skip("AFM_NO_EXTENSIONS is set for this run")
    c = importlib.import_module(f"afm_core._stream.{stem}_c")  # a missing build fails here
    dispatcher = importlib.import_module(f"afm_core._stream.{stem}")
    names = exported(stem)
    assert names and set(names) <= set(c.__all__)
    for name in names:
        assert getattr(dispatcher, name) is getattr(c, name), name


@pytest.mark.parametrize("stem", TWINS)
def test_twins_export_the_same_names(stem: str) -> None:
    c = importlib.import_module(f"afm_core._stream.{stem}_c")
    assert sorted(c.__all__) == sorted(exported(stem))


def test_no_extensions_env_selects_pure_twins() -> None:
    code = (
        "import importlib, json, sys\n"
        f"stems = {TWINS!r}\n"
        "out = {}\n"
        "for s in stems:\n"
        "    d = importlib.import_module('afm_core._stream.' + s)\n"
        "    py = importlib.import_module('afm_core._stream.' + s + '_py')\n"
        "    out[s] = all(getattr(d, n) is getattr(py, n) for n in py.__all__)\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "AFM_NO_EXTENSIONS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == dict.fromkeys(TWINS, True)
