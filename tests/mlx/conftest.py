"""Fixtures the MLX tests share."""

from __future__ import annotations

import pytest

from afm_core._mlx import qmatmul as _qmatmul


@pytest.fixture
def isa(request):
    """The quantized kernels' instruction set ``request.param`` for the test
    (``@pytest.mark.parametrize("isa", ..., indirect=True)``), the one in use
    before (the best, or ``AFM_QMM_ISA``'s) after."""
    ext = _qmatmul.extension()
    assert ext is not None
    before = ext.isa()
    assert ext.set_isa(request.param)
    yield request.param
    assert ext.set_isa(before)
