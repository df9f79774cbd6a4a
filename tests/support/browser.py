"""A real browser for the status page: the system's headless Chromium, driven by Playwright."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser")
HOW_TO_INSTALL = (
    "install Debian's chromium (scripts/install-system-deps.sh does, as root: "
    "apt-get install -y chromium) and the playwright wheel (pip install -e '.[dev]'); "
    "do not run `playwright install`, the system Chromium is used"
)


def chromium_path() -> str:
    """The system Chromium; the test fails, saying how to install it, without one."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail(f"no Chromium on PATH: {HOW_TO_INSTALL}")


@asynccontextmanager
async def chromium() -> AsyncIterator[Any]:
    """A headless Chromium (Playwright's ``Browser``), closed on exit."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail(f"the playwright package is missing: {HOW_TO_INSTALL}")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            yield browser
        finally:
            await browser.close()
