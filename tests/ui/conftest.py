"""A headless Chromium driven by selenium, for the chat page's tests.

Debian's ``chromium`` and ``chromium-driver`` (``.ci/deps.sh``
installs them as root) and ``selenium`` (the ``test`` extra); a test that
asks for ``browser`` is skipped, saying what is missing, where they are not.
The driver is given explicitly, so selenium never tries to download one.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
HOW = "apt-get install chromium chromium-driver, or run .ci/deps.sh as root"


def _found() -> tuple[str | None, str | None]:
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    return browser, shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("the chat page's browser tests need selenium (pip install -e '.[test]')")
    binary, driver = _found()
    if binary is None or driver is None:
        missing = " and ".join(n for n, p in (("chromium", binary), ("chromedriver", driver)) if not p)
        pytest.skip(f"the chat page's browser tests need {missing} ({HOW})")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,900", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    drv = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    try:
        yield drv
    finally:
        drv.quit()
