"""Headless Chromium for the browser tests (JupyterLab, the website): where it is, how it starts, why a test skips."""

import os
from pathlib import Path

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
# Flags for a machine without a display, a sandbox or a network: without the background-networking ones Chromium keeps
# trying to reach its services and failing.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def browser_missing() -> str | None:
    """Why the browser tests cannot run here (a line for the skip), or None."""
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "no playwright package (pip install playwright)"
    return None
