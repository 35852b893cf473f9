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


def _installed_layout(tmp_path: Path) -> dict[str, str]:
    """The sources laid out as they are installed (dcpstudio/{core,window,cli}); the environment that
    imports them from there."""
    pkg = tmp_path / "dcpstudio"
    shutil.copytree(ROOT / "app", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "core", pkg / "core", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def test_core_imports_no_qt_and_no_app_and_point_down(tmp_path: Path) -> None:
    """The contracts in pyproject.toml (core is Qt-free; core's floors import downwards only),
    checked on the sources laid out as they are installed."""
    env = _installed_layout(tmp_path)
    beside = Path(sys.executable).with_name("lint-imports")  # the venv's, even when it is not on PATH
    lint_imports = str(beside) if beside.exists() else shutil.which("lint-imports") or "lint-imports"
    result = _run(lint_imports, "--no-cache", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "5 kept, 0 broken" in result.stdout


CYCLES = """
import grimp
graph = grimp.build_graph("dcpstudio", include_external_packages=False)
found = set()
for module in graph.modules:
    for imported in graph.find_modules_directly_imported_by(module):
        related = module.startswith(imported + ".") or imported.startswith(module + ".")
        if imported != module and not related and graph.chain_exists(importer=imported, imported=module):
            found.add(" <-> ".join(sorted((module, imported))))
print("\\n".join(sorted(found)))
"""


def test_no_module_imports_one_that_imports_it_back(tmp_path: Path) -> None:
    """In core, the window and the command line: no import cycle, direct or through other modules."""
    env = _installed_layout(tmp_path)
    result = _run(sys.executable, "-c", CYCLES, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"import cycles:\n{result.stdout}"


def test_modules_stay_a_size_a_reader_can_hold() -> None:
    sizes = {p: len(p.read_text().splitlines()) for d in ("core", "app") for p in (ROOT / d).rglob("*.py")}
    assert not {str(p.relative_to(ROOT)): n for p, n in sizes.items() if n > 400}


def test_every_package_is_in_the_wheel() -> None:
    """pyproject's package list names every folder with an ``__init__.py`` (a package left out
    installs nowhere but works from an editable install)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for root, name in (("app", "dcpstudio"), ("core", "dcpstudio.core")):
        for init in (ROOT / root).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / root)
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set()
