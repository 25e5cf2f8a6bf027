"""The ``twin`` fixture: a stream test runs once on the Cython twins, once on the pure ones."""

from __future__ import annotations

import pytest

from tests.stream.helpers import TWINSETS, TwinSet


@pytest.fixture(scope="session", params=TWINSETS, ids=repr)
def twin(request: pytest.FixtureRequest) -> TwinSet:
    """``twin.detok`` is ``afm_core._stream.detok_c`` for ``[c]``, ``detok_py`` for ``[py]``
    (likewise every stage); ``[c]`` is skipped where that build is absent."""
    return request.param
