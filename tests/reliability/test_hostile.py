"""Hostile pickles in every place a checkpoint carries one, through every operation: no payload
runs, the error is a domain error, nothing is left at the destination."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import (
    DCPStudioError,
    UnsafePickleError,
    convert,
    diff,
    open_checkpoint,
    read_metadata,
    torch_save_to_dcp,
)
from tests.conftest import dcp_save, leftovers


def _payloads(marker: Path) -> dict[str, bytes]:
    code = f"open({str(marker)!r}, 'w').close()"
    m = repr(str(marker)).encode()
    return {
        "reduce-exec": pickle.dumps(_Reduce(exec, (code,)), protocol=2),
        "global-os-system": b"\x80\x02cos\nsystem\nq\x00X\x05\x00\x00\x00touch\x85R.",
        "subprocess": b"\x80\x02csubprocess\nPopen\n(X\x04\x00\x00\x00true\x85tR.",
        "builtins-eval": b"\x80\x02cbuiltins\neval\nX" + struct.pack("<I", len(code)) + code.encode() + b"\x85R.",
        "nested-build": b"\x80\x02ccollections\nOrderedDict\n)R}X\x08\x00\x00\x00__init__cbuiltins\nexec\nsbX"
        + struct.pack("<I", len(code))
        + code.encode()
        + b".",
        "huge-alloc": b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b"x",
        "touch-path": b"\x80\x02cpathlib\nPath.touch\n" + b"X" + struct.pack("<I", len(m)) + m + b"\x85R.",
    }


class _Reduce:
    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (self.fn, self.args)


def _torch_with_pickle(path: Path, pkl: bytes) -> None:
    """A valid torch.save archive whose data.pkl is replaced."""
    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, pkl if info.filename.endswith("/data.pkl") else zin.read(info))


def _dcp_with_metadata(path: Path, pkl: bytes) -> None:
    dcp_save({"w": torch.ones(3)}, checkpoint_id=path)
    (path / ".metadata").write_bytes(pkl)


def _dcp_with_byte_item(path: Path, pkl: bytes) -> None:
    """A DCP whose non-tensor value is a torch.save archive around the hostile pickle."""
    dcp_save({"w": torch.ones(3), "v": "x"}, checkpoint_id=path)
    md = read_metadata(path)
    (key,) = [k for k in md.storage_data if k.fqn == "v"]
    info = md.storage_data[key]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/version", "3\n")
    data_file = path / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(buf.getvalue())
    info.offset, info.length = offset, len(buf.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _safetensors_header(path: Path, pkl: bytes) -> None:
    header = b'{"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,4]}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)


PLACES = {"data.pkl": _torch_with_pickle, ".metadata": _dcp_with_metadata, "byte-item": _dcp_with_byte_item}
OPERATIONS = ["inspect", "convert", "verify"]


def _run(op: str, path: Path, out: Path) -> None:
    if op == "inspect":
        with open_checkpoint(path) as ckpt:
            for fqn, entry in ckpt.entries.items():
                ckpt.read_value(fqn) if entry.kind != "tensor" else ckpt.read_tensor(fqn)
    elif op == "convert":
        convert(path, out)
    else:
        with open_checkpoint(path) as a, open_checkpoint(path) as b:
            diff(a, b)


@pytest.mark.parametrize("op", OPERATIONS)
@pytest.mark.parametrize("place", list(PLACES))
def test_no_payload_runs(tmp_path: Path, place: str, op: str) -> None:
    marker = tmp_path / "PAYLOAD_RAN"
    for name, pkl in _payloads(marker).items():
        src = tmp_path / f"{place}-{name}"
        PLACES[place](src, pkl)
        out = tmp_path / f"out-{name}"
        expected = DCPStudioError if name == "huge-alloc" else UnsafePickleError  # huge: refused or truncated
        with pytest.raises(expected):
            _run(op, src, out)
        assert not marker.exists(), f"{name} in {place} ran during {op}"
        assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("op", OPERATIONS)
def test_hostile_safetensors_header(tmp_path: Path, op: str) -> None:
    src = tmp_path / "h.safetensors"
    _safetensors_header(src, b"")
    with pytest.raises(DCPStudioError, match=r"inconsistent|outside|overflows a 64-bit size"):
        _run(op, src, tmp_path / "out")


@pytest.mark.parametrize("place", ["data.pkl", ".metadata"])
def test_hostile_source_for_the_multi_rank_loader(tmp_path: Path, place: str) -> None:
    """Every rank fails with the coordinator's error; none is left waiting (or needs killing)."""
    from dcpstudio.core.ranks.launch import launch
    from dcpstudio.core.ranks.load import load_rank

    marker = tmp_path / "PAYLOAD_RAN"
    src = tmp_path / "evil"
    PLACES[place](src, _payloads(marker)["reduce-exec"])
    with pytest.raises(DCPStudioError, match=r"rank \d: .*: refused to load .builtins.exec."):  # its own words
        launch(load_rank, (str(src), "shard0", (2,)), nprocs=2, timeout=60)
    assert not marker.exists()


def test_counts_for_the_readme() -> None:
    assert len(_payloads(Path("/x"))) * len(PLACES) * len(OPERATIONS) == 63
    _ = torch_save_to_dcp  # the converters are exercised through convert()
