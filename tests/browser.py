"""Headless Chromium for the dashboard tests: Debian's ``chromium`` driven by Playwright
(never a browser Playwright downloads). Missing either one skips the test, unless
``LORAPLEX_REQUIRE_BROWSER=1`` (``.ci/run`` sets it): then it is a failure."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

REQUIRE_ENV = "LORAPLEX_REQUIRE_BROWSER"
CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """The system Chromium's path, or None."""
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _missing(why: str) -> None:
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{why} ({REQUIRE_ENV}=1)")
    pytest.skip(why)


@contextlib.contextmanager
def chromium_page() -> Iterator[Any]:
    """A fresh page in a fresh headless Chromium (its own context: its own sessionStorage)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install playwright)")
    exe = find_chromium()
    if exe is None:
        _missing("no system Chromium (apt-get install chromium)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=exe, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            page = browser.new_context().new_page()
            page.set_default_timeout(60_000)
            yield page
        finally:
            browser.close()
