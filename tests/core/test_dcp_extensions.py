"""A user-registered stream transform (torch's ``_extension_registry`` / ``_extensions``, as
torch's own tests use a rot13 one): what torch's FileSystemWriter writes with it our DCPReader
reads given the same registry, what our DCPWriter writes torch's FileSystemReader reads, and the
command line, which keeps to the built-in transforms, names it in one line."""

from __future__ import annotations

import io
from pathlib import Path
from typing import IO, Any, cast

import pytest
import torch

pytest.importorskip("torch.distributed.checkpoint._extension")

from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

_ON = bytes((b + 13) % 256 for b in range(256))  # every byte changes, not only letters
_OFF = bytes((b - 13) % 256 for b in range(256))


class Rot13(StreamTransformExtension):
    @staticmethod
    def registry_name() -> str:
        return "stream.rot13"

    @staticmethod
    def from_descriptor(version: str) -> Rot13:
        return Rot13()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b: Any) -> int:
                output.write(bytes(b).translate(_ON))
                return len(memoryview(b))

            def flush(self) -> None:
                output.flush()

        return cast(IO[bytes], Writer())

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        class Reader(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def readinto(self, b: Any) -> int:
                data = input.read(len(memoryview(b))).translate(_OFF)
                memoryview(b)[: len(data)] = data
                return len(data)

        return cast(IO[bytes], Reader())


class Endless(Rot13):
    """Reads back more than any item can hold: a transform's output is bounded like a decompression."""

    @staticmethod
    def from_descriptor(version: str) -> Endless:
        return Endless()

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        class Reader(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def readinto(self, b: Any) -> int:
                memoryview(b)[:] = b"\0" * len(memoryview(b))
                return len(memoryview(b))

        return cast(IO[bytes], Reader())


def registry(cls: type[StreamTransformExtension] = Rot13) -> ExtensionRegistry:
    found = ExtensionRegistry()
    found.register(cls)
    return found


def source() -> dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    return {"w": torch.randn(6, 5, generator=g), "h": torch.randn(4, generator=g).bfloat16(), "step": 7}


def target() -> dict[str, Any]:
    return {"w": torch.zeros(6, 5), "h": torch.zeros(4, dtype=torch.bfloat16), "step": 0}


def check(loaded: dict[str, Any]) -> None:
    want = source()
    assert torch.equal(loaded["w"], want["w"]) and torch.equal(loaded["h"], want["h"]) and loaded["step"] == 7


@pytest.fixture
def by_torch(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(source(), storage_writer=FileSystemWriter(tmp_path / "ck", _extensions=[Rot13()]), no_dist=True)
    return tmp_path / "ck"


def test_what_torch_writes_with_it_we_read_given_the_registry(by_torch: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from dcpstudio.core.formats.dcp.planners import SafeLoadPlanner
    from dcpstudio.core.formats.dcp.storage import DCPReader

    raw = (by_torch / "__0_0.distcp").read_bytes()
    assert b"data.pkl" not in raw  # the transform was applied: the archive's names are hidden
    loaded = target()
    dcp.load(loaded, storage_reader=DCPReader(by_torch, registry()), planner=SafeLoadPlanner(), no_dist=True)
    check(loaded)


@pytest.mark.parametrize(
    ("given", "refusal"),
    [
        (None, r"stored with the unknown transform 'stream\.rot13/1'"),
        (ExtensionRegistry(), r"\['stream\.rot13/1'\], which the extension registry cannot undo"),
        (registry(Endless), r"its transforms produce more than the \d+ bytes it can hold"),
    ],
)
def test_a_transform_we_cannot_undo_is_refused_in_one_line(
    by_torch: Path, given: ExtensionRegistry | None, refusal: str
) -> None:
    import re

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcpstudio.core.errors import DCPStudioError
    from dcpstudio.core.formats.dcp.planners import SafeLoadPlanner
    from dcpstudio.core.formats.dcp.storage import DCPReader, unwrap_error

    with pytest.raises(CheckpointException) as caught:
        dcp.load(target(), storage_reader=DCPReader(by_torch, given), planner=SafeLoadPlanner(), no_dist=True)
    error = unwrap_error(caught.value)
    assert isinstance(error, DCPStudioError) and "\n" not in str(error) and re.search(refusal, str(error)), error


def test_what_we_write_with_it_torch_reads(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from dcpstudio.core.formats.dcp.storage import DCPWriter

    dcp.save(source(), storage_writer=DCPWriter(tmp_path / "ck", _extensions=[Rot13()]), no_dist=True)
    assert b"data.pkl" not in (tmp_path / "ck" / "__0_0.distcp").read_bytes()
    loaded = target()
    dcp.load(loaded, storage_reader=FileSystemReader(tmp_path / "ck", _extension_registry=registry()), no_dist=True)
    check(loaded)


def test_the_command_line_names_the_transform(
    by_torch: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dcpstudio.cli.main import main

    assert main(["convert", str(by_torch), str(tmp_path / "out.pt"), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown transform 'stream.rot13/1'" in err, err
    assert not (tmp_path / "out.pt").exists()
