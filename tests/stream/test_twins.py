"""Every accelerated module loads its Cython build by default, its pure twin on request.

Discovered from the tree: each ``afm_core/_stream/X_py.py`` with an ``ext/stream/X_c.pyx``
must have a dispatcher ``afm_core._stream.X`` re-exporting the twin's ``__all__``, and
a stub ``afm_core/_stream/X_c.pyi`` with the pure twin's public API.  A missing build
fails ``test_cython_build_loads_by_default`` (unless ``AFM_NO_EXTENSIONS`` is set); a
build that exists but does not import is a logged warning, never a silent fallback.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.stream.helpers import ROOT, STEMS, C

NO_EXTENSIONS = os.environ.get("AFM_NO_EXTENSIONS", "") not in ("", "0")


def test_known_twins_are_discovered() -> None:
    assert {"detok", "reasoning", "sse", "accumulate", "tools", "pipeline"} <= set(STEMS)


def pure(stem: str) -> ModuleType:
    return importlib.import_module(f"afm_core._stream.{stem}_py")


@pytest.mark.parametrize("stem", STEMS)
def test_cython_build_loads_by_default(stem: str) -> None:
    if NO_EXTENSIONS:
        pytest.skip("AFM_NO_EXTENSIONS is set for this run")
    c = importlib.import_module(f"afm_core._stream.{stem}_c")  # a missing build fails here
    dispatcher = importlib.import_module(f"afm_core._stream.{stem}")
    assert dispatcher.COMPILED is True
    names = pure(stem).__all__
    assert names and set(names) <= set(c.__all__)
    for name in names:
        assert getattr(dispatcher, name) is getattr(c, name), name


@pytest.mark.parametrize("stem", STEMS)
def test_twins_export_the_same_names(stem: str) -> None:
    assert sorted(C.module(stem).__all__) == sorted(pure(stem).__all__)


# -- the stubs ------------------------------------------------------------------------

Params = tuple[tuple[str, str, bool], ...]  # (name, kind, has a default)


def ast_params(args: ast.arguments) -> Params:
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    out = [(a.arg, "positional", i >= first_default) for i, a in enumerate(positional)]
    if args.vararg:
        out.append((args.vararg.arg, "*", False))
    out += [(a.arg, "keyword", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        out.append((args.kwarg.arg, "**", False))
    return tuple(out)


def runtime_params(fn: Any) -> Params:
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.VAR_POSITIONAL: "*",
        inspect.Parameter.KEYWORD_ONLY: "keyword",
        inspect.Parameter.VAR_KEYWORD: "**",
    }
    return tuple(
        (p.name, kinds[p.kind], p.default is not inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values()
    )


def public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


def stub_api(path: Path) -> dict[str, Any]:
    """A stub's public names: functions' parameters, classes' members, re-exports' origin."""
    api: dict[str, Any] = {}
    for node in ast.parse(path.read_text("utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                if alias.asname == alias.name:  # an explicit re-export
                    api[alias.name] = ("from", f"afm_core._stream.{node.module}")
        elif isinstance(node, ast.FunctionDef) and public(node.name):
            api[node.name] = ast_params(node.args)
        elif isinstance(node, ast.ClassDef):
            members: dict[str, Any] = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and public(item.name):
                    prop = any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list)
                    members[item.name] = "data" if prop else ast_params(item.args)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members[item.target.id] = "data"
            api[node.name] = members
    return api


def init_attributes(cls: type) -> set[str]:
    """Public attributes that ``cls.__init__`` sets on ``self``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    names = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                if not t.attr.startswith("_"):
                    names.add(t.attr)
    return names


def pure_api(module: ModuleType, stub: dict[str, Any]) -> dict[str, Any]:
    """The pure twin's public names in the stub's terms."""
    api: dict[str, Any] = {}
    for name in module.__all__:
        obj = getattr(module, name)
        origin = stub.get(name)
        if isinstance(origin, tuple) and origin[:1] == ("from",):
            # the stub says: the same object as in that module
            api[name] = origin if getattr(importlib.import_module(origin[1]), name) is obj else "other"
        elif inspect.isclass(obj):
            members: dict[str, Any] = dict.fromkeys(init_attributes(obj), "data")
            for attr, value in vars(obj).items():
                if isinstance(value, property):
                    members[attr] = "data"
                elif inspect.isfunction(value) and public(attr):
                    members[attr] = runtime_params(value)
            api[name] = members
        else:
            api[name] = runtime_params(obj)
    return api


@pytest.mark.parametrize("stem", STEMS)
def test_stub_has_the_pure_twins_api(stem: str) -> None:
    path = ROOT / "afm_core" / "_stream" / f"{stem}_c.pyi"
    assert path.is_file(), f"no stub for afm_core._stream.{stem}_c"
    stub = stub_api(path)
    assert stub == pure_api(pure(stem), stub)


@pytest.mark.parametrize("stem", STEMS)
def test_stub_re_exports_are_the_builds_own(stem: str) -> None:
    c = C.module(stem)
    for name, origin in stub_api(ROOT / "afm_core" / "_stream" / f"{stem}_c.pyi").items():
        if isinstance(origin, tuple) and origin[:1] == ("from",):
            assert getattr(c, name) is getattr(importlib.import_module(origin[1]), name), name


# -- choosing the twin ---------------------------------------------------------------


def test_no_extensions_env_selects_pure_twins() -> None:
    code = (
        "import importlib, json, sys\n"
        f"stems = {STEMS!r}\n"
        "out = {}\n"
        "for s in stems:\n"
        "    d = importlib.import_module('afm_core._stream.' + s)\n"
        "    py = importlib.import_module('afm_core._stream.' + s + '_py')\n"
        "    out[s] = not d.COMPILED and all(getattr(d, n) is getattr(py, n) for n in py.__all__)\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "AFM_NO_EXTENSIONS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == dict.fromkeys(STEMS, True)


# Run in a fresh interpreter: import every dispatcher again, first with a corrupt
# ``X_c`` extension file ahead of the real build, then from a copy of the package
# that has no build at all; report what loaded and what was logged.
SCENARIOS = r"""
import importlib, json, logging, shutil, sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import afm_core._stream as pkg

stems, tmp = json.loads(sys.argv[1]), Path(sys.argv[2])
records = []

class Collect(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])

logging.getLogger("afm.stream").addHandler(Collect())

def load_all(path):
    for stem in stems:
        for name in (stem, stem + "_c", stem + "_py"):
            sys.modules.pop("afm_core._stream." + name, None)
            vars(pkg).pop(name, None)  # else `from . import X_c` returns the old one
    pkg.__path__[:] = path
    out = {}
    for stem in stems:
        records.clear()
        d = importlib.import_module("afm_core._stream." + stem)
        py = importlib.import_module("afm_core._stream." + stem + "_py")
        pure = all(getattr(d, n) is getattr(py, n) for n in py.__all__)
        out[stem] = {"compiled": d.COMPILED, "pure": pure, "log": list(records)}
    return out

real = list(pkg.__path__)
broken, absent = tmp / "broken", tmp / "absent"
broken.mkdir()
for stem in stems:
    (broken / (stem + "_c" + EXTENSION_SUFFIXES[0])).write_bytes(b"not a shared library")
shutil.copytree(real[0], absent, ignore=shutil.ignore_patterns(
    *("*" + s for s in EXTENSION_SUFFIXES), "__pycache__"))
print(json.dumps({"broken": load_all([str(broken), *real]), "absent": load_all([str(absent)])}))
"""


def test_broken_build_warns_and_absent_build_is_quiet(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AFM_NO_EXTENSIONS"}
    done = subprocess.run(
        [sys.executable, "-c", SCENARIOS, json.dumps(STEMS), str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for stem in STEMS:
        broken, absent = result["broken"][stem], result["absent"][stem]
        assert (broken["compiled"], broken["pure"]) == (False, True), stem
        ((level, message),) = broken["log"]
        assert level == "WARNING"
        assert f"afm_core._stream.{stem}_c exists but does not import (ImportError: " in message
        assert absent == {"compiled": False, "pure": True, "log": []}, stem
