"""The packages type-check (mypy settings in pyproject.toml)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# A clean clone has no mypy cache: its first run is the slowest (tens of seconds, more on a slow,
# loaded CI machine); the subprocess's own limit governs, not the default per-test one.
@pytest.mark.timeout(900)
def test_mypy_finds_no_errors_in_the_packages():
    pytest.importorskip("mypy", reason="mypy (the dev extra) is not installed")
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
