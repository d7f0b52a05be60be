"""Lint as part of the test run: ``ruff check`` and ``mypy``, configured in pyproject.toml.

Both run from this interpreter's environment (``python -m ruff``, ``python -m mypy``), the
one ``scripts/setup.sh`` fills from the ``test`` extra, so the README's test command
(and CI, which runs it) fails on a lint or type error with the tool's own report.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run_tool(module: str, *args: str, timeout_s: float) -> None:
    """Run ``python -m module args`` in the repository root; fail with its output unless it exits 0."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]')")
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join([module, *args])} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}", pytrace=False)


def test_ruff_is_clean() -> None:
    # Every Python file of the repository: the package, the tests, examples/ and scripts/
    # (ruff skips what .gitignore lists: .venv, build/, ...).
    _run_tool("ruff", "check", ".", timeout_s=300)


def test_mypy_is_clean() -> None:
    # The files and options are pyproject's [tool.mypy]; .mypy_cache makes a rerun take seconds.
    _run_tool("mypy", timeout_s=900)
