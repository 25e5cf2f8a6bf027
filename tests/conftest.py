"""Shared fixtures: offline test models, built once per session."""

from __future__ import annotations

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
