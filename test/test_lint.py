"""ruff over the package, the tests, the tools and the launch files (ruff.toml), as ament_flake8 does for
ROS packages: a new lint error fails the suite."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff")
    assert ruff, "ruff is not installed (tools/requirements.txt installs it)"
    res = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
