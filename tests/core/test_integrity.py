"""Bad input gets a one-line domain error; nothing is left behind; destinations are protected."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from dcpstudio.core import (
    CancelledError,
    CancelToken,
    CorruptCheckpointError,
    DCPStudioError,
    DestinationExistsError,
    UnsupportedFormatError,
    convert,
    dcp_to_torch_save,
    detect_format,
    read_metadata,
    torch_save_to_dcp,
)
from tests.conftest import assert_same, leftovers, rich_state_dict


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_garbage_and_empty_inputs(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(os.urandom(4096).replace(b"\x80", b"\x00").replace(b"PK", b"pk"))
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    for path in (garbage, empty, tmp_path / "missing.pt", tmp_path):
        with pytest.raises(UnsupportedFormatError) as info:
            convert(path, tmp_path / "out")
        assert str(path) in _one_line(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cut", [0.02, 0.3, 0.6, 0.98])
def test_truncated_torch_save(rich_pt: Path, tmp_path: Path, cut: float) -> None:
    data = rich_pt.read_bytes()
    bad = tmp_path / "cut.pt"
    bad.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(DCPStudioError) as info:
        torch_save_to_dcp(bad, tmp_path / "out")
    assert "cut.pt" in _one_line(info.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_storage_record_shorter_than_its_tensor(tmp_path: Path) -> None:
    """A ZIP whose central directory is intact but whose data record was emptied."""
    import zipfile

    src = tmp_path / "a.pt"
    torch.save({"w": torch.ones(1000)}, src)
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bad, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, b"" if info.filename.endswith("data/0") else zin.read(info))
    with pytest.raises(CorruptCheckpointError, match="data/0"):
        torch_save_to_dcp(bad, tmp_path / "out")


def test_truncated_and_missing_dcp_data(rich_pt: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    torch_save_to_dcp(rich_pt, ckpt)
    (data_file,) = ckpt.glob("*.distcp")
    original = data_file.read_bytes()
    data_file.write_bytes(original[: len(original) // 2])
    with pytest.raises(CorruptCheckpointError) as info:
        dcp_to_torch_save(ckpt, tmp_path / "out.pt")
    assert data_file.name in _one_line(info.value)
    data_file.unlink()
    with pytest.raises(CorruptCheckpointError, match="cannot open DCP data file"):
        dcp_to_torch_save(ckpt, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists() and leftovers(tmp_path) == []


def test_damaged_or_missing_metadata(rich_pt: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    torch_save_to_dcp(rich_pt, ckpt)
    md = ckpt / ".metadata"
    md.write_bytes(md.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
        read_metadata(ckpt)
    md.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"no \.metadata"):
        detect_format(ckpt)


def test_existing_destination_is_never_overwritten_silently(rich_pt: Path, tmp_path: Path) -> None:
    dst_dir = tmp_path / "dcp"
    dst_dir.mkdir()
    (dst_dir / "keep.txt").write_text("precious")
    with pytest.raises(DestinationExistsError, match="--overwrite"):
        torch_save_to_dcp(rich_pt, dst_dir)
    assert (dst_dir / "keep.txt").read_text() == "precious"

    # --overwrite replaces a checkpoint of the target's kind, never an arbitrary folder or file
    with pytest.raises(DCPStudioError, match=r"refusing to replace .* not a checkpoint, not a DCP checkpoint"):
        torch_save_to_dcp(rich_pt, dst_dir, overwrite=True)
    assert (dst_dir / "keep.txt").read_text() == "precious"
    (dst_dir / "keep.txt").unlink()
    torch_save_to_dcp(rich_pt, dst_dir, overwrite=True)  # an empty folder may be written into
    torch_save_to_dcp(rich_pt, dst_dir, overwrite=True, exclude="^optim")  # and a DCP checkpoint replaced
    assert (dst_dir / ".metadata").is_file()

    dst_file = tmp_path / "out.pt"
    dst_file.write_bytes(b"precious")
    with pytest.raises(DestinationExistsError):
        dcp_to_torch_save(dst_dir, dst_file)
    with pytest.raises(DCPStudioError, match=r"not a torch\.save file"):
        dcp_to_torch_save(dst_dir, dst_file, overwrite=True)
    assert dst_file.read_bytes() == b"precious"
    torch_save_to_dcp(rich_pt, tmp_path / "d0")
    with pytest.raises(DCPStudioError, match=r"it is a DCP checkpoint, not a torch\.save file"):
        dcp_to_torch_save(dst_dir, tmp_path / "d0", overwrite=True)
    dst_file.unlink()
    dcp_to_torch_save(tmp_path / "d0", dst_file)
    dcp_to_torch_save(tmp_path / "d0", dst_file, overwrite=True)
    assert_same(rich_state_dict(), torch.load(dst_file, weights_only=True))
    assert leftovers(tmp_path) == []


def test_destination_that_contains_the_source_is_never_deleted(rich_pt: Path, tmp_path: Path) -> None:
    """``convert work/model.pt work --overwrite`` must not delete the folder holding the source:
    a DCP is written into it (tests/core/test_destinations.py), anything else is refused."""
    data = rich_pt.read_bytes()
    with pytest.raises(DCPStudioError, match="contains the source"):
        convert(rich_pt, rich_pt.parent, to="safetensors", overwrite=True)
    torch_save_to_dcp(rich_pt, rich_pt.parent, overwrite=True)
    assert rich_pt.read_bytes() == data


@pytest.mark.parametrize("direction", ["to_dcp", "to_torch"])
@pytest.mark.parametrize("after", [0, 1, 5])
def test_cancel_midway_leaves_nothing(tmp_path: Path, direction: str, after: int) -> None:
    from dcpstudio.core.ops.demo import llama_like_state_dict

    src = tmp_path / "src.pt"
    torch.save(llama_like_state_dict(4 << 20), src)
    if direction == "to_torch":
        torch_save_to_dcp(src, tmp_path / "src_dcp")
        src = tmp_path / "src_dcp"
    token = CancelToken()
    calls = []

    def progress(p: object) -> None:
        calls.append(p)
        if len(calls) > after:
            token.cancel()

    dst = tmp_path / "out"
    with pytest.raises(CancelledError):
        convert(src, dst, progress=progress, cancel=token)
    assert not dst.exists() and leftovers(tmp_path) == []


def test_cancel_keeps_existing_destination(rich_pt: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out.pt"
    torch.save({"previous": torch.ones(2)}, dst)
    before = dst.read_bytes()
    torch_save_to_dcp(rich_pt, tmp_path / "d")
    token = CancelToken()
    token.cancel()
    with pytest.raises(CancelledError):
        dcp_to_torch_save(tmp_path / "d", dst, overwrite=True, cancel=token)
    assert dst.read_bytes() == before


def test_include_exclude(rich_pt: Path, tmp_path: Path) -> None:
    torch_save_to_dcp(rich_pt, tmp_path / "d", exclude=r"^optim\.")
    keys = set(read_metadata(tmp_path / "d").state_dict_metadata)
    assert not any(k.startswith("optim.") for k in keys) and "model.w" in keys and "step" in keys

    dcp_to_torch_save(tmp_path / "d", tmp_path / "m.pt", include=r"^model\.", exclude="bf16|f8")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    expected = {k: v for k, v in rich_state_dict()["model"].items() if k not in ("bf16", "f8")}
    assert_same({"model": expected}, got)

    with pytest.raises(ValueError, match="invalid name pattern"):
        torch_save_to_dcp(rich_pt, tmp_path / "e", include="(")


def test_destination_that_is_a_file_of_the_source_is_refused(rich_pt: Path, tmp_path: Path) -> None:
    """Inside a DCP folder a new file is allowed (as torch allows it); its own files are not."""
    torch_save_to_dcp(rich_pt, tmp_path / "d")
    with pytest.raises(DCPStudioError, match="inside"):
        dcp_to_torch_save(tmp_path / "d", tmp_path / "d" / "__0_0.distcp", overwrite=True)


def test_unwritable_destination(rich_pt: Path, tmp_path: Path) -> None:
    with pytest.raises(DCPStudioError, match="does not exist"):
        torch_save_to_dcp(rich_pt, tmp_path / "no" / "such" / "dir")


def test_non_dict_torch_save_is_explained(tmp_path: Path) -> None:
    src = tmp_path / "t.pt"
    torch.save(torch.ones(3), src)
    with pytest.raises(UnsupportedFormatError, match="holds a Tensor"):
        torch_save_to_dcp(src, tmp_path / "out")


def test_stale_temporaries_of_killed_runs_are_cleaned(rich_pt: Path, tmp_path: Path) -> None:
    """A temporary is stale when nobody holds its lock -- whatever its PID says (PIDs repeat across
    namespaces); one whose lock is held by a live writer is left alone."""
    import fcntl
    import os

    stale = tmp_path / f".out.dcpstudio-tmp-{os.getpid()}-abcd1234"  # a live PID, yet abandoned
    (stale / "out").mkdir(parents=True)
    (stale / ".dcpstudio.lock").touch()
    unlocked_old = tmp_path / ".out.dcpstudio-tmp-12-00000000"  # from before locks: judged by age
    unlocked_old.mkdir()
    os.utime(unlocked_old, (0, 0))
    live = tmp_path / ".out.dcpstudio-tmp-999999999-ffffffff"
    live.mkdir()
    fd = os.open(live / ".dcpstudio.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        torch_save_to_dcp(rich_pt, tmp_path / "out")
        assert not stale.exists() and not unlocked_old.exists() and live.exists()
    finally:
        os.close(fd)
    torch_save_to_dcp(rich_pt, tmp_path / "out", overwrite=True)
    assert leftovers(tmp_path) == []


def test_failure_while_writing_leaves_nothing(rich_pt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dcpstudio.core.formats.torchsave import zip_writer as _zip

    real = _zip.ZipWriter.write
    calls = {"n": 0}

    def failing(self: _zip.ZipWriter, name: str, data: object, crc: int | None = None) -> None:
        calls["n"] += 1
        if calls["n"] == 8:
            raise OSError(28, "No space left on device")
        real(self, name, data, crc)  # type: ignore[arg-type]

    monkeypatch.setattr(_zip.ZipWriter, "write", failing)
    with pytest.raises(DCPStudioError, match="No space left on device"):
        torch_save_to_dcp(rich_pt, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: {"s": torch.eye(3).to_sparse()}, r"'s' is a sparse_coo tensor; only dense"),
        (
            lambda: {"q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)},
            "tensor type DCP Studio cannot read",
        ),
        (lambda: torch.nn.Linear(2, 2), r"refused to load 'torch\.nn\.modules\.linear\.Linear'"),
    ],
)
def test_tensor_types_we_cannot_stream_are_explained(tmp_path: Path, make: object, expected: str) -> None:
    src = tmp_path / "x.pt"
    torch.save(make(), src)  # type: ignore[operator]
    with pytest.raises(DCPStudioError, match=expected):
        torch_save_to_dcp(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_parameters_convert_as_tensors(tmp_path: Path) -> None:
    torch.save({"p": torch.nn.Parameter(torch.arange(3.0))}, tmp_path / "p.pt")
    torch_save_to_dcp(tmp_path / "p.pt", tmp_path / "d")
    dcp_to_torch_save(tmp_path / "d", tmp_path / "back.pt")
    assert torch.equal(torch.load(tmp_path / "back.pt", weights_only=True)["p"], torch.arange(3.0))
