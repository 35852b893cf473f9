"""torch.save archives that other tools repacked with deflated records, and ZIP directories that
lie: read exactly as ``torch.load(weights_only=True)`` reads them, or refused in one line; no
record inflates past what it declares or what its reader has room for (issue 24, items 4 and 10)."""

from __future__ import annotations

import io
import struct
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch

from dcpstudio.core import convert, open_checkpoint
from dcpstudio.core.errors import CorruptCheckpointError
from dcpstudio.core.formats.torchsave.archive import TorchSaveFile
from dcpstudio.core.formats.torchsave.zip import read_zip_records
from tests._zips import MIB, repack, stored, torch_records, zeros_deflated, zip_archive

TENSORS = ("w", "wt", "rows", "half", "bf", "shared")


@pytest.fixture
def deflated(tmp_path: Path) -> Path:
    """Views, a transpose, 16-bit dtypes, a shared storage and plain values; every record deflated."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(12, 10, generator=g)
    state = {
        "w": w,
        "wt": w.t(),
        "rows": w[3:7],
        "half": torch.randn(33, generator=g).half(),
        "bf": torch.randn(4, 5, generator=g).bfloat16(),
        "shared": w.view(-1)[5:25],
        "step": 11,
        "cfg": {"name": "run", "lr": 0.5},
    }
    torch.save(state, tmp_path / "plain.pt")
    return repack(tmp_path / "plain.pt", tmp_path / "deflated.pt", lambda name: True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def test_deflated_records_read_as_torch_loads_them(deflated: Path) -> None:
    expected = torch.load(deflated, weights_only=True)
    with open_checkpoint(deflated) as ckpt:
        for name in TENSORS:
            got = ckpt.read_tensor(name)
            assert got.dtype == expected[name].dtype and torch.equal(_bits(got), _bits(expected[name])), name
        assert torch.equal(ckpt.read_tensor("w", (slice(2, 5), slice(3, 7))), expected["w"][2:5, 3:7])
        assert ckpt.read_value("step") == 11 and ckpt.read_value("cfg.name") == "run"


@pytest.mark.parametrize("to", ["torch", "dcp", "safetensors"])
def test_deflated_records_convert_bit_exactly(deflated: Path, tmp_path: Path, to: str) -> None:
    expected = torch.load(deflated, weights_only=True)
    out = tmp_path / f"out.{to}"
    convert(deflated, out, to=to)  # type: ignore[arg-type]
    with open_checkpoint(out) as ckpt:
        for name in TENSORS:
            assert torch.equal(_bits(ckpt.read_tensor(name)), _bits(expected[name])), name


def test_a_deflated_storage_is_inflated_in_blocks_not_whole(tmp_path: Path) -> None:
    """16 MiB of storage: converting it allocates a few MiB at a time (zipfile's read held it whole,
    then copied it)."""
    torch.save({"w": torch.arange(4 << 20, dtype=torch.float32)}, tmp_path / "big.pt")
    src = repack(tmp_path / "big.pt", tmp_path / "big_deflated.pt", lambda name: "/data/" in name)
    tracemalloc.start()
    try:
        convert(src, tmp_path / "out.safetensors", to="safetensors")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * MIB, peak
    with open_checkpoint(tmp_path / "out.safetensors") as ckpt:
        assert torch.equal(ckpt.read_tensor("w"), torch.arange(4 << 20, dtype=torch.float32))


def _pickle_archive(size: int, declared: int | None = None) -> bytes:
    """An archive whose deflated data.pkl is ``{"x": bytes(size)}`` (declaring ``declared`` bytes)."""
    head = b"\x80\x02}X\x01\x00\x00\x00x\x8e" + struct.pack("<Q", size)
    stream, crc = zeros_deflated(head, size, b"s.")
    pkl = ("archive/data.pkl", stream, 8, len(head) + size + 2 if declared is None else declared, crc)
    return zip_archive([pkl, stored("archive/version", b"3\n")])


def test_a_deflated_pickle_past_its_limit_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    path = tmp_path / "bomb.pt"
    path.write_bytes(_pickle_archive(65 * MIB))  # torch.load reads it: 65 MiB of zeros
    with pytest.raises(CorruptCheckpointError, match=r"data\.pkl would inflate to 65\.0 MiB, more than the 64\.0 MiB"):
        TorchSaveFile(path)


def test_a_deflated_pickle_that_inflates_past_its_declared_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "lies.pt"
    path.write_bytes(_pickle_archive(4 * MIB, declared=1000))
    with pytest.raises(CorruptCheckpointError, match=r"inflates past the 1000 bytes its directory declares"):
        TorchSaveFile(path)


def _storage_archive(numel: int, zeros: int, declared: int) -> bytes:
    records = torch_records(numel)
    stream, crc = zeros_deflated(b"", zeros, b"")
    data = ("archive/data/0", stream, 8, declared, crc)
    return zip_archive([records[0], data, *records[1:]])


@pytest.mark.parametrize(
    ("numel", "zeros", "declared", "message"),
    [
        (MIB // 4, 2 * MIB, MIB, "inflates past the 1048576 bytes"),
        (MIB // 2, MIB, 2 * MIB, r"inflates to 1048576 bytes, its directory says 2097152"),
        (MIB // 4, MIB, 2 * MIB, "holds 2097152 bytes; its storage has 1048576"),
    ],
)
def test_a_storage_record_whose_size_lies_is_refused(
    tmp_path: Path, numel: int, zeros: int, declared: int, message: str
) -> None:
    path = tmp_path / "lies.pt"
    path.write_bytes(_storage_archive(numel, zeros, declared))
    with pytest.raises(CorruptCheckpointError, match=message), open_checkpoint(path) as ckpt:
        ckpt.read_tensor("w")


def test_an_archive_in_memory_inflates_within_its_budget() -> None:
    data = _storage_archive(MIB, 4 * MIB, 4 * MIB)
    assert TorchSaveFile(io.BytesIO(data)).obj["w"].shape == (MIB,)
    small = TorchSaveFile(io.BytesIO(data), inflate_limit=2 * MIB)
    with pytest.raises(CorruptCheckpointError, match=r"more than the 2\.0 MiB a value may hold"):
        small.storage_bytes(small.obj["w"].storage)


def _with_entries(count: int, pickle_last: bool = False) -> bytes:
    name = b"archive/pad"
    entry = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, 0, 0, 0, len(name), 0, 0, 0, 0, 0, 0)
    return zip_archive(torch_records(4, data=True), (entry + name) * count, count, first=pickle_last)


@pytest.mark.parametrize("pickle_last", [False, True])
def test_a_directory_listing_more_than_its_storages_is_refused(tmp_path: Path, pickle_last: bool) -> None:
    path = tmp_path / "many.pt"
    path.write_bytes(_with_entries(100_000, pickle_last))
    with pytest.raises(CorruptCheckpointError, match=r"lists 100007 entries, but its pickle references only 1"):
        TorchSaveFile(path)
    path.write_bytes(_with_entries(20))  # a few stray records are allowed
    assert TorchSaveFile(path).obj["w"].shape == (4,)


def test_a_tensor_chunk_archive_may_list_only_a_few_records(tmp_path: Path) -> None:
    data = io.BytesIO(_with_entries(40))
    with pytest.raises(CorruptCheckpointError, match="lists 47 entries; an archive like this holds at most 33"):
        read_zip_records(data, "chunk", max_entries=33)


def _torch_refuses(path: Path) -> None:
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises: it does not load it
        torch.load(path, weights_only=True)


def test_the_folder_is_the_first_entrys_as_torch_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "two.pt"
    path.write_bytes(zip_archive([stored("other/x", b""), *torch_records(4, data=True)]))
    _torch_refuses(path)
    with pytest.raises(CorruptCheckpointError, match=r"without a torch data\.pkl"):
        TorchSaveFile(path)


def test_a_record_listed_twice_is_refused(tmp_path: Path) -> None:
    records = torch_records(4, data=True)
    path = tmp_path / "twice.pt"
    path.write_bytes(zip_archive([*records, stored("archive/data/0", b"\x01" * 16)]))
    with pytest.raises(CorruptCheckpointError, match="lists archive/data/0 twice"):
        TorchSaveFile(path)


def test_an_unknown_byte_order_is_refused_as_torch_refuses_it(tmp_path: Path) -> None:
    records = [r if not r[0].endswith("byteorder") else stored(r[0], b"middle") for r in torch_records(4, data=True)]
    path = tmp_path / "order.pt"
    path.write_bytes(zip_archive(records))
    _torch_refuses(path)
    with pytest.raises(CorruptCheckpointError, match="unknown byte order"):
        TorchSaveFile(path)


def test_a_deflated_byteorder_is_read_inflated(tmp_path: Path) -> None:
    """``big``, deflated: torch byte-swaps the storage; so do we (before, the compressed bytes were
    compared with ``big``)."""
    torch.save({"w": torch.arange(6, dtype=torch.int32)}, tmp_path / "le.pt")
    with zipfile.ZipFile(tmp_path / "le.pt") as z:
        names = [i.filename for i in z.infolist()]
        payloads = {n: z.read(n) for n in names}
    swapped = torch.arange(6, dtype=torch.int32).numpy().byteswap().tobytes()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for n in names:
            data = b"big" if n.endswith("byteorder") else swapped if n.endswith("data/0") else payloads[n]
            z.writestr(zipfile.ZipInfo(n), data, compress_type=zipfile.ZIP_DEFLATED)
    (tmp_path / "be.pt").write_bytes(out.getvalue())
    expected = torch.load(tmp_path / "be.pt", weights_only=True)["w"]
    assert expected.tolist() == list(range(6))
    with open_checkpoint(tmp_path / "be.pt") as ckpt:
        assert torch.equal(ckpt.read_tensor("w"), expected)
