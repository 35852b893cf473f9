"""Destinations as torch's converters allow them -- a torch.save file inside the DCP folder it
comes from, a DCP written into the folder that holds its source file -- without ever replacing
or deleting the source."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from dcpstudio.core.errors import DCPStudioError, DestinationExistsError
from dcpstudio.core.ops.convert.convert import convert, dcp_to_torch_save, torch_save_to_dcp
from dcpstudio.core.ops.integrity import check_path
from tests.conftest import assert_same, leftovers, rich_state_dict


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative name, with a digest of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def load_dcp(folder: Path) -> dict[str, object]:
    """What torch's own converter reads from the DCP in ``folder``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as torch_dcp_to_torch_save

    out = folder.parent / f"{folder.name}-by-torch.pt"
    torch_dcp_to_torch_save(folder, out)
    try:
        return torch.load(out, weights_only=False)
    finally:
        out.unlink()


def test_a_torch_save_file_written_inside_its_dcp_source(rich_pt: Path, tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    torch_save_to_dcp(rich_pt, src)
    before = snapshot(src)
    dcp_to_torch_save(src, src / "model.pt")
    after = snapshot(src)
    assert {k: v for k, v in after.items() if k != "model.pt"} == before  # the source's files, bit-identical
    assert_same(rich_state_dict(), torch.load(src / "model.pt", weights_only=True))
    dcp_to_torch_save(src, src / "model.pt", overwrite=True)  # replacing our own output, not the source
    assert {k: v for k, v in snapshot(src).items() if k != "model.pt"} == before and leftovers(src) == []
    for part in [".metadata", "__0_0.distcp"]:  # the source's own files are never replaced
        with pytest.raises(DCPStudioError, match=f"destination .*{part} is inside the source"):
            dcp_to_torch_save(src, src / part, overwrite=True)
    assert {k: v for k, v in snapshot(src).items() if k != "model.pt"} == before


def test_a_dcp_written_into_the_folder_of_its_source_file(rich_pt: Path) -> None:
    folder = rich_pt.parent
    (folder / "notes.txt").write_text("mine")
    before = snapshot(folder)
    torch_save_to_dcp(rich_pt, folder)
    after = snapshot(folder)
    assert {k: v for k, v in after.items() if k in before} == before  # source and neighbours bit-identical
    assert sorted(set(after) - set(before)) == [".metadata", "__0_0.distcp", "dcpstudio-manifest.json"]
    assert_same(rich_state_dict(), load_dcp(folder))
    with pytest.raises(DestinationExistsError, match="already holds a DCP checkpoint"):
        torch_save_to_dcp(rich_pt, folder)
    torch.save({"w": torch.arange(3.0)}, folder / "other.pt")
    convert(folder / "other.pt", folder, to="dcp", overwrite=True)  # --overwrite replaces the DCP's files only
    assert {k: v for k, v in snapshot(folder).items() if k in before} == before
    assert_same({"w": torch.arange(3.0)}, load_dcp(folder))
    # the earlier DCP's manifest goes with it: it would describe files that are no longer its
    convert(folder / "other.pt", folder, to="dcp", overwrite=True, manifest=False, for_ranks=2)
    assert not (folder / "dcpstudio-manifest.json").exists() and check_path(folder).whole
    assert leftovers(folder) == []


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_other_formats_never_replace_the_folder_of_their_source(rich_pt: Path, to: str) -> None:
    folder = rich_pt.parent
    before = snapshot(folder)
    with pytest.raises(DCPStudioError, match=r"contains the source .*only a DCP checkpoint can be written into it"):
        convert(rich_pt, folder, to=to, overwrite=True)  # type: ignore[arg-type]
    assert snapshot(folder) == before


def test_a_file_converted_onto_itself_is_refused(rich_pt: Path) -> None:
    before = snapshot(rich_pt.parent)
    with pytest.raises(DCPStudioError, match="is the source; choose another path"):
        convert(rich_pt, rich_pt, to="torch", overwrite=True)
    assert snapshot(rich_pt.parent) == before


def test_a_dcp_file_that_would_replace_the_source_is_refused(tmp_path: Path) -> None:
    """A source file named like the DCP's own files is never written over."""
    src = tmp_path / "__0_0.distcp"
    torch.save({"w": torch.ones(2)}, src)
    before = snapshot(tmp_path)
    with pytest.raises(DCPStudioError, match=r"its file __0_0\.distcp would replace the source"):
        convert(src, tmp_path, to="dcp")
    assert snapshot(tmp_path) == before and leftovers(tmp_path) == []


def test_inside_a_folder_that_is_not_a_dcp_is_refused(tmp_path: Path) -> None:
    """A folder of safetensors shards is every file in it: another file there would change it."""
    from safetensors.torch import save_file

    src = tmp_path / "shards"
    src.mkdir()
    save_file({"a": torch.ones(2)}, src / "part1.safetensors")
    save_file({"b": torch.ones(2)}, src / "part2.safetensors")
    with pytest.raises(DCPStudioError, match="is inside the source"):
        convert(src, src / "merged.safetensors", to="safetensors")
    assert sorted(p.name for p in src.iterdir()) == ["part1.safetensors", "part2.safetensors"]
