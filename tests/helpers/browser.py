"""Headless Chromium for the tests that look at a page: a screenshot and the rendered DOM."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

# As root, with no network: no sandbox, and none of Chromium's background connections.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]  # fmt: skip


def render_page(page: Path, tmp_path: Path, window: str = "1200,3000") -> tuple[bytes, str]:
    """The page's screenshot (PNG bytes) and its DOM as Chromium rendered it; skips the test
    where Chromium is not installed."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (Debian package chromium; .ci/run installs it)")
    base = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"]
    shot = tmp_path / "page.png"
    subprocess.run(
        [*base, f"--screenshot={shot}", f"--window-size={window}", page.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    dom = subprocess.run(
        [*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120,
        check=True,
    ).stdout  # fmt: skip
    return shot.read_bytes(), dom
