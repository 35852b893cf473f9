"""Ruff, mypy and the import-linter contract run as part of the test suite."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_ruff_lint_and_format() -> None:
    lint = _run(sys.executable, "-m", "ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run(sys.executable, "-m", "ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy() -> None:
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_core_imports_no_qt_and_no_app(tmp_path: Path) -> None:
    """The contract in pyproject.toml, checked on the sources laid out as they are installed."""
    pkg = tmp_path / "dcpstudio"
    shutil.copytree(ROOT / "cli", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("core", "app"):
        shutil.copytree(ROOT / sub, pkg / sub, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    beside = Path(sys.executable).with_name("lint-imports")  # the venv's, even when it is not on PATH
    lint_imports = str(beside) if beside.exists() else shutil.which("lint-imports") or "lint-imports"
    result = _run(lint_imports, "--no-cache", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 kept, 0 broken" in result.stdout
