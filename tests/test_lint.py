"""The code base passes the project's linter (ruff, configured in ruff.toml), as TRL's CI checks its own."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache",
         "trl_federated", "tests", "examples", "benchmarks", "setup.py"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
