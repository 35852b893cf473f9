"""Inputs that are not state dicts of dense tensors are named in one line: a TorchScript archive, a
meta-device tensor (entry and file), a sparse or quantized entry -- which ``--exclude`` leaves out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpstudio.cli.main import main
from dcpstudio.core.checkpoints.opening import open_checkpoint
from dcpstudio.core.errors import UnsupportedFormatError
from dcpstudio.core.ops.convert.convert import convert


@pytest.mark.parametrize("trust", [False, True])
def test_torchscript_archive_is_named(tmp_path: Path, trust: bool) -> None:
    src = tmp_path / "ts.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 2)), src)
    with pytest.raises(UnsupportedFormatError, match=r"a TorchScript archive \(torch\.jit\.save\).*state_dict\(\)"):
        open_checkpoint(src, trust_pickle=trust)


def test_meta_tensor_message_names_entry_and_file(tmp_path: Path) -> None:
    src = tmp_path / "meta.pt"
    torch.save({"m": torch.empty(3, 2, device="meta"), "w": torch.ones(2)}, src)
    with pytest.raises(UnsupportedFormatError, match=r"meta\.pt: 'm' is a tensor on the meta device"):
        convert(src, tmp_path / "out.safetensors", to="safetensors")
    convert(src, tmp_path / "w.pt", to="torch", exclude="^m$")
    assert list(torch.load(tmp_path / "w.pt", weights_only=True)) == ["w"]


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (torch.eye(3).to_sparse(), "sparse_coo"),
        (torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8), "quantized"),
    ],
)
def test_exclude_lets_the_rest_convert(
    tmp_path: Path, value: torch.Tensor, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "x.pt"
    torch.save({"odd": value, "w": torch.arange(3.0)}, src)
    assert main(["convert", "-q", str(src), str(tmp_path / "all.pt")]) == 1
    err = capsys.readouterr().err
    assert f"'odd' is a {kind} tensor" in err and "--exclude" in err and len(err.strip().splitlines()) == 1
    for target in ("out.pt", "out.safetensors", "out_dcp"):
        assert main(["convert", "-q", "--exclude", "^odd$", str(src), str(tmp_path / target)]) == 0
    with open_checkpoint(tmp_path / "out_dcp") as out:
        assert set(out.entries) == {"w"} and torch.equal(out.read_tensor("w"), torch.arange(3.0))
