"""Shared fixtures: offline test models, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import afm_core  # noqa: F401  (registers the afm_echo architecture)
from afm_core.testing import make_echo_model, make_random_model


@pytest.fixture(scope="session")
def echo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_echo_model(tmp_path_factory.mktemp("echo"))


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_model(tmp_path_factory.mktemp("random"))


@pytest.fixture
def isa(request: pytest.FixtureRequest):
    """The quantized kernels' instruction set ``request.param`` for the test
    (``@pytest.mark.parametrize("isa", ..., indirect=True)``), the one in use
    before (the best, or ``AFM_QMM_ISA``'s) after."""
    from afm_core._mlx import qmatmul

    ext = qmatmul.extension()
    assert ext is not None
    before = ext.isa()
    assert ext.set_isa(request.param)
    yield request.param
    assert ext.set_isa(before)


def pytest_report_header() -> list[str]:
    """Which CPU paths this run exercises (tests/test_kernel_paths.py reruns the others)."""
    from afm_core._mlx import qmatmul
    from afm_core._mlx.blas import blas_info

    isa = qmatmul.kernel_isa()
    forced = " (AFM_QMM_ISA)" if os.environ.get("AFM_QMM_ISA") else ""
    return [f"afm kernels: {isa or 'none (MLX kernels)'}{forced}; BLAS: {blas_info().describe()}"]
