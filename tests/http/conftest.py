"""Fixtures the HTTP tests share with other folders: the headless Chromium of
``tests/ui`` (skipped, saying why, where it is missing)."""

from tests.ui.conftest import browser  # noqa: F401 - registered here as a fixture
