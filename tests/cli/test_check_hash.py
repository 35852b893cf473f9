"""``dcpstudio check`` (exit 0 whole; 1 with a summary line and the findings) and ``dcpstudio hash``
(``digest  dtype  shape  name`` per entry, the same for the same tensors in another format)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from dcpstudio.cli.main import main
from dcpstudio.core import convert, open_checkpoint


@pytest.fixture
def dcp(tmp_path: Path) -> Path:
    torch.save({"w": torch.arange(60.0).reshape(6, 10), "n": torch.tensor(3), "step": 2}, tmp_path / "m.pt")
    convert(tmp_path / "m.pt", tmp_path / "m.dcp", to="dcp")
    return tmp_path / "m.dcp"


def test_check_exit_codes_summary_and_json(dcp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(dcp), "-q", "--values"]) == 0
    assert capsys.readouterr().out.startswith(f"whole: {dcp} (dcp, 3 entries, 1 file)")
    with open_checkpoint(dcp) as ckpt:
        (c,) = ckpt.resolve_chunks("w")
    assert c.data_offset is not None and c.file is not None
    (dcp / "dcpstudio-manifest.json").unlink(missing_ok=True)  # the structure alone (a manifest finds any flip)
    with open(dcp / c.file, "r+b") as f:
        f.seek(c.data_offset + 4)
        f.write(struct.pack("<f", float("inf")))
    assert main(["check", str(dcp), "-q"]) == 0
    assert main(["check", str(dcp), "-q", "--values"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("damaged: ") and lines[-2].endswith("1 finding")
    assert lines[-1] == f"  {c.file}: 'w': 1 Inf values"
    assert main(["check", str(dcp), "-q", "--values", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["whole"] is False and report["findings"] == [{"file": c.file, "entry": "w", "what": "1 Inf values"}]
    assert {v["name"]: v["inf"] for v in report["values"]} == {"w": 1, "n": 0}


def test_check_of_what_cannot_be_opened(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    header = json.dumps({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "cut.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    assert main(["check", str(tmp_path / "cut.safetensors"), "-q"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("damaged: ") and len(out) == 2
    assert out[1].startswith("  cut.safetensors: the tensors' data ends at byte ")


def test_hash_lines_and_json(dcp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hash", str(tmp_path / "m.pt"), "-q"]) == 0
    from_pt = capsys.readouterr().out.splitlines()
    assert main(["hash", str(dcp), "-q"]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == sorted(from_pt)
    digest, dtype, shape, name = next(line for line in from_pt if line.endswith("  w")).split("  ")
    assert digest.startswith("sha256-tree:") and len(digest) == len("sha256-tree:") + 64
    assert (dtype, shape, name) == ("float32", "[6,10]", "w")
    assert any(line.endswith("  value  -  step") for line in from_pt)
    assert main(["hash", str(dcp), "-q", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["algorithm"] == "sha256-tree" and {e["name"] for e in out["entries"]} == {"w", "n", "step"}


def test_hash_manifest_then_diff_digests(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import torch

    from dcpstudio.cli.main import main

    torch.save({"w": torch.zeros(8), "v": torch.ones(3)}, tmp_path / "a.pt")
    torch.save({"w": torch.zeros(8), "v": torch.full((3,), 2.0)}, tmp_path / "b.pt")
    assert main(["hash", "-q", "--manifest", str(tmp_path / "a.pt")]) == 0
    assert main(["hash", "-q", "--manifest", str(tmp_path / "b.pt")]) == 0
    capsys.readouterr()
    assert main(["diff-digests", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 1
    assert "changed: v" in capsys.readouterr().out
