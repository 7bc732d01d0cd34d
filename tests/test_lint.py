"""The linter holds the code: ``python -m ruff check src tests benchmarks examples`` (configured in pyproject.toml)
finds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    pytest.importorskip("ruff")  # in the test extra; skipped only where it is not installed
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "benchmarks", "examples"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
