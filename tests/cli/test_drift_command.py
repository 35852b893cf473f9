"""``dcpstudio drift RUN``: the JSON others read (its schema), CSV, text, exit codes, one-line errors."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from dcpstudio.cli.main import main


def test_json_schema_and_exit_codes(training_runs: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """An object with "steps" (ascending), "series" (entry -> metric -> a list aligned with the steps)
    and "anomalies" ({step: int, entry: str, kind: str, detail: str}); exit 1 with anomalies."""
    assert main(["drift", str(training_runs["faulty"]), "--json", "-q"]) == 1
    data = json.loads(capsys.readouterr().out)
    steps = data["steps"]
    assert steps == sorted(steps) == list(range(1, 13))
    for name, metrics in data["series"].items():
        for metric, values in metrics.items():
            assert len(values) == len(steps), (name, metric)
    assert data["series"]["model.output.weight"]["nan"][9] == 1
    kinds = {"spike", "frozen", "nonfinite", "reverted", "layout"}
    for a in data["anomalies"]:
        assert isinstance(a["step"], int) and a["step"] in steps
        assert isinstance(a["entry"], str) and isinstance(a["detail"], str) and a["kind"] in kinds
    assert {(a["step"], a["kind"]) for a in data["anomalies"]} == {(4, "frozen"), (7, "spike"), (9, "layout"),
                                                                   (10, "nonfinite")}  # fmt: skip
    assert data["values"]["train_state.step"] == steps


def test_csv_text_and_a_clean_run(training_runs: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    run = str(training_runs["resumed"])
    assert main(["drift", run, "--csv", "-q", "--pattern", r"step-(?P<step>\d+)"]) == 1
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    wq = [r for r in rows if r["entry"] == "model.layers.0.attention.wq.weight"]
    assert [int(r["step"]) for r in wq] == list(range(1, 13))
    assert wq[0]["rel_change"] == "" and float(wq[1]["rel_change"]) > 0
    assert main(["drift", run, "-q"]) == 1  # cached now: the same answer
    out = capsys.readouterr().out
    assert out.startswith(f"{run}: a run of 12 checkpoints (torchtitan), steps 1..12") and "step 9: reverted:" in out
    if training_runs["healthy"] is not None:
        assert main(["drift", str(training_runs["healthy"]), "-q"]) == 0
        assert capsys.readouterr().out.rstrip().endswith("0 anomalies")


def test_errors(tmp_path: Path, training_runs: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["drift", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dcpstudio: error: ") and "not a run" in err
    assert main(["drift", str(training_runs["faulty"]), "--pattern", "step-("]) == 2
    assert "not a regular expression" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["drift", str(training_runs["faulty"]), "--json", "--csv"])
    assert e.value.code == 2
