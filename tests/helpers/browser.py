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
    shot.unlink(missing_ok=True)  # a page rendered before in the folder is not this one
    screenshot = [f"--screenshot={shot}", f"--window-size={window}"]
    # One start for both (a Chromium start is 1-2 s of a loaded 2-core machine); a Chromium
    # whose headless mode takes one command a start writes only one, so it is started again.
    dom = _run([*base, *screenshot, "--dump-dom", page.as_uri()])
    if not shot.exists():
        _run([*base, *screenshot, page.as_uri()])
    if "<html" not in dom:
        dom = _run([*base, "--dump-dom", page.as_uri()])
    return shot.read_bytes(), dom


def _run(command: list[str]) -> str:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=120, check=True
    ).stdout  # fmt: skip
