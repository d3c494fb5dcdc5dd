"""`nox -s smoke` in the suite: all three systems touched end to end in a few seconds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from measure.results import REPO_ROOT


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_passes():
    cmd = [sys.executable, "-m", "artifacts.smoke"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("\nok   ") + done.stdout.startswith("ok   ") == 3
