"""No code from a checkpoint runs unless the user trusts it explicitly."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from dcpstudio.core import (
    DCPReader,
    UnsafePickleError,
    dcp_to_torch_save,
    detect_format,
    read_metadata,
    torch_save_to_dcp,
)
from dcpstudio.core.formats.dcp.storage import unwrap_error as _unwrap
from tests.conftest import assert_same, dcp_load, dcp_save, leftovers


class Payload:
    """Unpickling this runs ``exec``: it creates ``marker``, a side effect tests can observe."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PAYLOAD_RAN"


def test_hostile_data_pkl_is_refused(tmp_path: Path, marker: Path) -> None:
    src = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(3)}, "note": Payload(marker)}, src)
    with pytest.raises(UnsafePickleError, match=r"'(builtins\.)?exec'.*--trust-pickle"):
        torch_save_to_dcp(src, tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_trust_pickle_is_an_explicit_opt_in(tmp_path: Path, marker: Path) -> None:
    src = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(3)}, "note": Payload(marker)}, src)
    with pytest.warns(UserWarning, match="trusting pickles"):
        torch_save_to_dcp(src, tmp_path / "out", trust_pickle=True)
    assert marker.exists()


def _hostile_metadata_dir(tmp_path: Path, marker: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(4)}, checkpoint_id=ckpt)
    md = read_metadata(ckpt)
    md.planner_data = {"w": ("w",), "x": Payload(marker)}  # type: ignore[dict-item]
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    return ckpt


def test_hostile_metadata_is_refused(tmp_path: Path, marker: Path) -> None:
    ckpt = _hostile_metadata_dir(tmp_path, marker)
    assert detect_format(ckpt) == "dcp"
    with pytest.raises(UnsafePickleError, match=r"builtins\.exec"):
        dcp_to_torch_save(ckpt, tmp_path / "out.pt")
    with pytest.raises(UnsafePickleError):
        DCPReader(ckpt).read_metadata()
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists() and leftovers(tmp_path) == []


def test_hostile_metadata_global_is_named(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(4)}, checkpoint_id=ckpt)
    # a pickle that only imports os.system (GLOBAL opcode) must already be refused
    (ckpt / ".metadata").write_bytes(b"\x80\x02cos\nsystem\nq\x00.")
    with pytest.raises(UnsafePickleError, match=r"'os\.system'"):
        read_metadata(ckpt)


def test_hostile_byte_item_is_refused(tmp_path: Path, marker: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(4), "extra": Payload(marker)}, checkpoint_id=ckpt)
    assert not marker.exists()
    with pytest.raises(UnsafePickleError, match="extra"):
        dcp_to_torch_save(ckpt, tmp_path / "out.pt")
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()
    # excluding the hostile entry converts the rest
    dcp_to_torch_save(ckpt, tmp_path / "out.pt", exclude="^extra$")
    assert_same({"w": torch.ones(4)}, torch.load(tmp_path / "out.pt", weights_only=True))
    assert not marker.exists()


def test_safe_planner_protects_dcp_load(tmp_path: Path, marker: Path) -> None:
    from dcpstudio.core import SafeLoadPlanner

    ckpt = tmp_path / "ckpt"
    dcp_save({"w": torch.ones(4), "extra": Payload(marker)}, checkpoint_id=ckpt)
    target = {"w": torch.zeros(4), "extra": None}
    with pytest.raises(CheckpointException) as info:
        dcp_load(target, storage_reader=DCPReader(ckpt), planner=SafeLoadPlanner())
    assert isinstance(_unwrap(info.value), UnsafePickleError)
    assert not marker.exists()
    # torch's own planner would have run it: that is what SafeLoadPlanner is for
    dcp_load(target, storage_reader=DCPReader(ckpt), planner=SafeLoadPlanner(trust_pickle=True))
    assert marker.exists()
