"""What the stream tests share: both twins of every accelerated stage, and text splitting.

``C`` and ``PY`` hold the Cython and the pure twin of each stage (``C.detok``
is ``afm_core._stream.detok_c``); the ``twin`` fixture (``conftest.py``) runs
a test once with each, and differential tests use both at once.  A compiled
module is imported when a test first uses it, so collection never needs the
build; where it is absent the test is skipped, saying so (a build that exists
but does not import fails the test).  ``test_twins.py`` is what fails when
the build is missing.

``split_at`` / ``random_split`` / ``each_boundary`` cut a text, byte string
or token list into the pieces a stream delivers; ``feed_all`` runs a
``feed`` / ``flush`` stage over them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sized
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, TypeVar

import pytest
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]


def twin_stems() -> list[str]:
    """Every stage with a pure twin ``afm_core/_stream/X_py.py`` and an ``ext/stream/X_c.pyx``."""
    stems = []
    for py in sorted((ROOT / "afm_core" / "_stream").glob("*_py.py")):
        stem = py.stem.removesuffix("_py")
        if (ROOT / "ext" / "stream" / f"{stem}_c.pyx").exists():
            stems.append(stem)
    return stems


STEMS = twin_stems()


def twin_module(stem: str, kind: str) -> ModuleType:
    """``afm_core._stream.{stem}_{kind}`` (``kind`` "c" or "py"); skips the test
    when the Cython build of it is absent."""
    name = f"afm_core._stream.{stem}_{kind}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if kind != "c" or exc.name != name:
            raise
        pytest.skip(f"{name} is not built (python setup.py build_ext --inplace)")


def _stage(stem: str) -> Any:
    return property(lambda self: self.module(stem), doc=f"afm_core._stream.{stem}_c or _py")


class TwinSet:
    """One twin, ``kind`` "c" or "py", of every accelerated stage."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return self.kind

    def module(self, stem: str) -> ModuleType:
        return twin_module(stem, self.kind)

    detok = _stage("detok")
    reasoning = _stage("reasoning")
    tools = _stage("tools")
    sse = _stage("sse")
    pipeline = _stage("pipeline")
    accumulate = _stage("accumulate")


C = TwinSet("c")
PY = TwinSet("py")
TWINSETS = (C, PY)


# -- splitting -----------------------------------------------------------------

class _Sliceable(Sized, Protocol):
    def __getitem__(self, key: slice, /) -> Any: ...


S = TypeVar("S", bound=_Sliceable)


def split_at(seq: S, cuts: Iterable[int]) -> list[S]:
    """``seq`` cut at each position in ``cuts`` (any order, clamped to the
    sequence); a repeated cut gives an empty piece.  The pieces join to ``seq``."""
    n = len(seq)
    bounds = sorted(min(max(c, 0), n) for c in cuts)
    return [seq[a:b] for a, b in zip([0, *bounds], [*bounds, n], strict=True)]


def each_boundary(seq: S) -> list[S]:
    """``seq`` cut at every boundary: one item (character, byte, token) per piece."""
    return split_at(seq, range(1, len(seq)))


def cuts(seq: Sized, max_cuts: int = 12) -> st.SearchStrategy[list[int]]:
    """Random cut positions for ``seq`` (repeats and both ends included)."""
    return st.lists(st.integers(0, len(seq)), max_size=max_cuts)


def random_split(data: st.DataObject, seq: S, max_cuts: int = 12) -> list[S]:
    """``seq`` cut at up to ``max_cuts`` positions drawn from ``data``."""
    return split_at(seq, data.draw(cuts(seq, max_cuts), label="cuts"))


def feed_all(stage: Any, pieces: Iterable[Any]) -> list[Any]:
    """The events of ``stage.feed(piece)`` for each piece, then of ``stage.flush()``."""
    out: list[Any] = []
    for piece in pieces:
        out.extend(stage.feed(piece))
    out.extend(stage.flush())
    return out
