"""``dcpstudio compare A B``: the compare view's rows on the terminal, from the same core function
(:func:`dcpstudio.core.ops.compare.diff.compare`), as a table, JSON or CSV; exit 0 equal, 1 different, 2 error."""

from __future__ import annotations

import csv
import importlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.cli.main import main
from dcpstudio.core import open_checkpoint
from dcpstudio.core.ops.compare.diff import compare


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    common = {"w": torch.ones(4), "step": 3}
    torch.save({**common, "moved": torch.tensor([1.0, 2.0]), "gone": torch.zeros(1)}, tmp_path / "a.pt")
    torch.save({**common, "moved": torch.tensor([1.0, 2.5]), "new": torch.zeros(1)}, tmp_path / "b.pt")
    return tmp_path / "a.pt", tmp_path / "b.pt"


def test_table_and_exit_codes(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(pair[0]), str(pair[1]), "-q"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["entry", "status", "max", "|Δ|", "rel", "L2", "cosine"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    assert rows["w"] == ["equal", "0", "0", "1"]
    assert rows["moved"][:2] == ["different", "0.5"] and rows["moved"][2] == f"{0.5 / 5**0.5:.4g}"
    assert rows["gone"] == ["only", "in", "A", "—", "—", "—"]
    assert lines[-1] == "equal: 2, different: 1, only in A: 1 (gone), only in B: 1 (new)"
    assert main(["compare", str(pair[0]), str(pair[1]), "-q", "--differences-only"]) == 1
    assert not any(line.startswith(("w ", "step ")) for line in capsys.readouterr().out.splitlines())
    assert main(["compare", str(pair[0]), str(pair[0]), "-q"]) == 0
    capsys.readouterr()
    assert main(["compare", str(pair[0]), str(pair[1].with_name("missing.pt"))]) == 2
    assert capsys.readouterr().err.startswith("dcpstudio: error:")


def test_tolerances_decide_equality(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"w": torch.tensor([1.0, 2.0])}, tmp_path / "a.pt")
    torch.save({"w": torch.tensor([1.0, 2.001])}, tmp_path / "b.pt")
    assert main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "-q"]) == 1
    assert main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "-q", "--atol", "0.01"]) == 0
    assert main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "-q", "--rtol", "1e-3"]) == 0


def test_json_and_csv_are_the_core_rows(
    pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    diff = importlib.import_module("dcpstudio.core.ops.compare.diff")  # the package's diff() hides the module
    with open_checkpoint(pair[0]) as a, open_checkpoint(pair[1]) as b:
        expected = compare(a, b)
    calls: list[Any] = []
    monkeypatch.setattr(diff, "compare", lambda *a, **k: calls.append(k) or compare(*a, **k))
    assert main(["compare", str(pair[0]), str(pair[1]), "--json", "--atol", "0.25"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert calls and calls[0]["atol"] == 0.25 and data["atol"] == 0.25 and data["equal"] is False
    assert [(e["fqn"], e["status"]) for e in data["entries"]] == [(r.fqn, r.status) for r in expected]
    moved = next(e for e in data["entries"] if e["fqn"] == "moved")
    assert moved["max_abs"] == 0.5 and moved["shape_a"] == [2] and moved["status_text"] == "different"
    assert main(["compare", str(pair[0]), str(pair[1]), "--csv"]) == 1
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["fqn"] for r in table] == [r.fqn for r in expected]
    moved_row = next(r for r in table if r["fqn"] == "moved")
    assert float(moved_row["rel_l2"]) == next(r.rel_l2 for r in expected if r.fqn == "moved")
    assert next(r for r in table if r["fqn"] == "step")["max_abs"] == ""


def test_help_lists_compare_and_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in (
        ([], ["compare", "compare two checkpoints entry by entry"]),
        (["verify"], ["Exit 0 when equal", "checkpoint A"]),
        (["open"], ["Open the DCP Studio window", "any checkpoint"]),
        (["load"], ["(default: shard0)", "(default: 2, or the size of --mesh", "(default: 600)"]),
        (["compare"], ["--differences-only", "--csv", "--rtol", "relative L2"]),
    ):
        with pytest.raises(SystemExit) as done:
            main([*argv, "--help"])
        assert done.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert all(w in text for w in words), (argv, text)
