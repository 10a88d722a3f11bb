"""Debian's Chromium, headless, driven by Playwright (never a browser Playwright downloads)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.conf import settings

CHROMIUM = "/usr/bin/chromium"
# No background networking: this machine's closed network would refuse Chromium's own calls.
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = Path(settings.BASE_DIR) / "var" / "screenshots"


@contextmanager
def chromium_page(*, width: int, height: int) -> Iterator:
    """A page in a fresh browser; JavaScript errors on it fail the test."""
    assert Path(CHROMIUM).exists() or shutil.which("chromium"), (
        "The browser tests need Debian's chromium: run scripts/install-system-deps"
    )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_context(viewport={"width": width, "height": height}).new_page()
        page.set_default_timeout(15_000)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        yield page
        browser.close()
        assert errors == [], f"JavaScript errors: {errors}"
