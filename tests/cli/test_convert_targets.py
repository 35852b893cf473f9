"""``convert SRC DST`` without ``--to``: the destination's name decides the target; a ``--to`` the
name contradicts is a usage error naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpstudio.cli.main import main
from dcpstudio.core import detect_format


@pytest.fixture
def sources(rich_pt: Path, tmp_path: Path) -> dict[str, Path]:
    assert main(["convert", str(rich_pt), str(tmp_path / "src_dcp"), "--to", "dcp", "-q"]) == 0
    st = tmp_path / "src.safetensors"
    assert main(["convert", str(rich_pt), str(st), "--to", "safetensors", "-q"]) == 0
    return {"torch": rich_pt, "dcp": tmp_path / "src_dcp", "safetensors": st}


@pytest.mark.filterwarnings("ignore:safetensors holds tensors only")
@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        ("safetensors", "out.pt", "torch"),
        ("safetensors", "out.pth", "torch"),
        ("torch", "out.safetensors", "safetensors"),
        ("dcp", "out.safetensors", "safetensors"),
        ("dcp", "out.bin", "torch"),
        ("dcp", "out", "dcp"),
        ("safetensors", "out/", "dcp"),
    ],
)
def test_suffix_decides_the_target(
    sources: dict[str, Path], tmp_path: Path, src: str, dst: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = f"{tmp_path}/{dst}"
    assert main(["convert", str(sources[src]), out]) == 0
    assert f"({expected})" in capsys.readouterr().out
    assert detect_format(out.rstrip("/")) == expected


@pytest.mark.filterwarnings("ignore:safetensors holds tensors only")
def test_trailing_separator_with_shards_is_sharded_safetensors(sources: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "shards"
    assert main(["convert", str(sources["torch"]), f"{out}/", "--max-shard-size", "200B", "-q"]) == 0
    assert (out / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--to", "dcp"], ["--to dcp", "out.pt", "torch.save"]),
        (["--to", "safetensors"], ["--to safetensors", "out.pt", "torch.save"]),
    ],
)
def test_contradicting_to_is_a_usage_error(
    sources: dict[str, Path], tmp_path: Path, args: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["convert", str(sources["torch"]), str(tmp_path / "out.pt"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
    assert not (tmp_path / "out.pt").exists()


def test_torch_into_a_directory_and_named_commands_are_refused(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["convert", str(sources["dcp"]), f"{tmp_path / 'o'}/", "--to", "torch"]) == 2
    assert "trailing separator" in capsys.readouterr().err
    assert main(["dcp_to_torch", str(sources["dcp"]), str(tmp_path / "o.safetensors")]) == 2
    assert "dcp_to_torch writes a torch.save file" in capsys.readouterr().err
    assert main(["convert", str(sources["dcp"]), str(tmp_path / "plain"), "--to", "torch", "-q"]) == 0
    assert detect_format(tmp_path / "plain") == "torch"


def test_destination_kind_reads_the_last_component_only() -> None:
    from dcpstudio.core.ops.convert.convert import destination_kind

    assert destination_kind("s3://bucket/run.v2/model.PT") == "torch"
    assert destination_kind("s3://bucket/run.v2/out/") == "directory"
    assert destination_kind("s3://bucket/run.v2/ckpt") == "bare"
    assert destination_kind("https://host/m.safetensors") == "safetensors"
    assert destination_kind("llama-3.1") is None  # a suffix that names no format: the source decides
