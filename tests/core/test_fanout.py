"""The total output bound (issue 24, item 5): a storage viewed under many names is refused where
the target would write it once per name, written when the caller allows it, and kept as one
storage where the target can share it (torch.save, cast or not)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.cli.main import main as cli
from dcpstudio.core import ExpansionError, convert, torch_save_to_dcp
from tests.conftest import leftovers

_FLOOR = 1 << 20  # the 1 GiB floor, scaled down so the files stay small


@pytest.fixture(autouse=True)
def _small_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dcpstudio.core.ops.convert.fanout.OUTPUT_FLOOR", _FLOOR)


def _fanout(path: Path, names: int = 64, numel: int = 64 << 10) -> dict[str, Any]:
    """``names`` views (whole, reshaped, sliced) of one float32 storage of ``numel`` elements: 256 KiB
    stored, 16 MiB written out name by name."""
    storage = torch.arange(numel, dtype=torch.float32)
    kinds = [storage, storage.view(64, -1), storage[3:], storage.view(-1, 2)[:, 1]]
    state: dict[str, Any] = {f"layer.{i}.w": kinds[i % len(kinds)] for i in range(names)}
    state["step"] = 5
    torch.save(state, path)
    return state


@pytest.mark.parametrize("target", ["dcp", "safetensors"])
def test_views_of_one_storage_are_refused_before_anything_is_written(tmp_path: Path, target: str) -> None:
    _fanout(tmp_path / "fan.pt")
    with pytest.raises(ExpansionError) as caught:
        convert(tmp_path / "fan.pt", tmp_path / "out", to=target)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "64 entries view one stored 256.0 KiB ('layer.0.w' is one)" in message, message
    assert "--allow-expansion" in message and "\n" not in message
    assert (caught.value.name, caught.value.views, caught.value.stored) == ("layer.0.w", 64, 256 << 10)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.filterwarnings("ignore:safetensors holds tensors only")
def test_allow_expansion_writes_every_view(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    state = _fanout(tmp_path / "fan.pt")
    convert(tmp_path / "fan.pt", tmp_path / "out.safetensors", to="safetensors", allow_expansion=True)
    loaded = load_file(tmp_path / "out.safetensors")
    assert len(loaded) == 64
    for name, t in loaded.items():
        assert torch.equal(t, state[name])


def test_a_few_views_are_not_refused(tmp_path: Path) -> None:
    _fanout(tmp_path / "fan.pt", names=8)  # 8 x 256 KiB over the floor, but only 8x what is stored
    convert(tmp_path / "fan.pt", tmp_path / "out", to="dcp")
    assert (tmp_path / "out" / ".metadata").is_file()


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_torch_target_keeps_views_of_one_storage_shared(tmp_path: Path, dtype: str | None) -> None:
    state = _fanout(tmp_path / "fan.pt")
    convert(tmp_path / "fan.pt", tmp_path / "out.pt", to="torch", dtype=dtype)  # type: ignore[arg-type]
    assert (tmp_path / "out.pt").stat().st_size < 2 * (256 << 10)
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert len({t.untyped_storage().data_ptr() for t in loaded.values() if isinstance(t, torch.Tensor)}) == 1
    for name, t in state.items():
        if isinstance(t, torch.Tensor):
            want = t if dtype is None else t.to(torch.bfloat16)
            got = loaded[name]
            assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
                want.dtype,
                t.shape,
                t.stride(),
                t.storage_offset(),
            )
            assert torch.equal(got, want), name
    assert loaded["step"] == 5


def test_dcp_entries_reading_one_storage_record_are_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint.metadata as dcp_md

    torch.save({"w": torch.zeros(64 << 10)}, tmp_path / "one.pt")
    torch_save_to_dcp(tmp_path / "one.pt", tmp_path / "ckpt")
    md = pickle.loads((tmp_path / "ckpt" / ".metadata").read_bytes())
    (key,) = md.storage_data
    for i in range(100):
        md.state_dict_metadata[f"copy{i}"] = md.state_dict_metadata["w"]
        md.storage_data[dcp_md.MetadataIndex(f"copy{i}", key.offset)] = md.storage_data[key]
        md.planner_data[f"copy{i}"] = (f"copy{i}",)
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(md))
    for target in ("torch", "safetensors", "dcp"):
        with pytest.raises(ExpansionError, match=r"101 entries view one stored 256\.0 KiB"):
            convert(tmp_path / "ckpt", tmp_path / f"out.{target}", to=target)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "one.pt"]


@pytest.mark.filterwarnings("ignore:safetensors holds tensors only")
def test_cli_refuses_in_one_line_and_writes_with_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fanout(tmp_path / "fan.pt")
    out = tmp_path / "out.safetensors"
    assert cli(["convert", str(tmp_path / "fan.pt"), str(out), "--to", "safetensors", "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dcpstudio: error:") and "layer.0.w" in err[0], err
    assert not out.exists()
    assert cli(["convert", str(tmp_path / "fan.pt"), str(out), "--to", "safetensors", "-q", "--allow-expansion"]) == 0
    assert out.stat().st_size > 64 * (200 << 10)
