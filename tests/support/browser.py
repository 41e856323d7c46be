"""The system Chromium for Playwright: found on PATH, or installed from Debian's packages when missing.

NOTE: ``playwright install`` downloads its own browser builds, which cannot be fetched here; Debian's ``chromium``
package can, so the tests drive that binary (headless, no sandbox: the tests run as root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO_ROOT / "test-artifacts"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


def chromium_path() -> str:
    """The Chromium binary, installing Debian's package first when it is missing (fails the test if it can't)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.fail("chromium is not installed and cannot be installed here: run `apt-get install -y chromium`")
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-500:]}")
    found = shutil.which("chromium")
    if not found:
        pytest.fail("apt-get installed chromium but it is not on PATH")
    return found


def screenshot_path(name: str) -> Path:
    """Where a test saves a screenshot (``test-artifacts/screenshots/``, kept after the run)."""
    folder = ARTIFACTS / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}.png"
