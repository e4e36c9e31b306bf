"""The code stays clean under ruff, as configured in pyproject.toml: `ruff check .` and `ruff format --check .`, run
from the repository root as a contributor runs them (about a second each)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    """`python -m ruff ARGS` in the repository root, with this interpreter (the project's environment)."""
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_ruff_check_finds_nothing():
    done = ruff("check", "--output-format", "concise", ".")
    assert done.returncode == 0, f"ruff check . found problems:\n{done.stdout}{done.stderr}"


@pytest.mark.slow
def test_ruff_format_would_change_nothing():
    done = ruff("format", "--check", ".")
    assert done.returncode == 0, f"ruff format --check . would reformat:\n{done.stdout}{done.stderr}"
