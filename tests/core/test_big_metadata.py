"""The benchmark's huge ``.metadata`` writer (tests/perf/big_metadata.py) writes what torch's
``FileSystemWriter`` would: the same pickle opcodes as ``pickle.dump`` of torch's own metadata
classes (frames aside), loadable by torch's ``FileSystemReader``."""

from __future__ import annotations

import pickle
import pickletools
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from dcpstudio.core import open_checkpoint
from tests.perf import big_metadata


def _opcodes(data: bytes) -> list[tuple[str, object]]:
    return [(op.name, arg) for op, arg, _ in pickletools.genops(data) if op.name != "FRAME"]


@pytest.mark.parametrize(("tensors", "ranks"), [(1, 1), (3, 2), (1001, 2), (500, 2), (40, 30)])
def test_the_writer_matches_torch(tmp_path: Path, tensors: int, ranks: int) -> None:
    big_metadata.write_metadata(tmp_path / ".metadata", tensors, ranks)
    ours = (tmp_path / ".metadata").read_bytes()
    expected = big_metadata.torch_metadata(tensors, ranks)
    assert _opcodes(ours) == _opcodes(pickle.dumps(expected))
    md = FileSystemReader(tmp_path).read_metadata()
    md.storage_meta.load_id = None  # type: ignore[union-attr]  # set by the reader
    assert md == expected
    with open_checkpoint(tmp_path) as ckpt:
        fqn = big_metadata.name(tensors - 1)
        assert ckpt.entries[fqn].shape == (ranks * 4, 4096)
        chunks = ckpt.chunks(fqn)
        assert [c.offsets for c in chunks] == [(r * 4, 0) for r in range(ranks)]
        assert chunks[-1].file == f"__{ranks - 1}_0.distcp"
        assert chunks[-1].offset == (tensors - 1) * big_metadata.item_length(4, 4096)
