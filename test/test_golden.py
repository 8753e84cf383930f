"""The same prompts give the same tokens, rounds and bytes as the code recorded before the round loops
became one (tools/golden.py; the two intended changes are listed there with their reason)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_cases_equal_the_recording():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "golden.py"), "check"], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "12 of 12 cases equal the recording" in res.stdout
