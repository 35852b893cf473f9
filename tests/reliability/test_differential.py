"""Differential test of our DCP ``.metadata`` parsers against torch's own reader: thousands of
crafted-but-loadable streams (``differential.py``), each read by torch and by each of our parsers;
any difference we did not refuse fails. ``DCPSTUDIO_DIFF_CASES=5000`` runs a longer campaign."""

from __future__ import annotations

import collections
import os
import pickle
import struct

import pytest

from dcpstudio.core.pickles.guard import lands_on
from tests.reliability import differential

CASES = int(os.environ.get("DCPSTUDIO_DIFF_CASES", "240"))


def test_our_parsers_read_what_torch_reads() -> None:
    differing, fast, tricks = [], 0, collections.Counter()
    for seed in range(CASES):
        data, used = differential.case(seed)
        tricks.update(set(used))
        found = differential.differences(data)
        if found:
            differing.append(f"case {seed} ({', '.join(sorted(set(used)))}): {found[0]}")
        fast += "fast" in differential.ours(data)
    assert differing == [], "\n".join(differing[:10])
    # the campaign exercised what it is for: the bulk parse took streams, and every trick was drawn
    assert fast >= CASES // 10
    want = {"bytes-under-both-keys", "scalar-under-both-keys", "decoy-argument", "memo-variants", "frames"}
    assert want | {"save-plans"} <= set(tricks), tricks


def test_a_byte_item_reads_the_record_torch_reads_not_a_decoy_under_offset_empty() -> None:
    """torch keys storage by MetadataIndex(fqn, offset): a byte item is read under offset None, a 0-d
    tensor under (); a record under the other key is never read (it was folded in before)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    scalar = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([]), [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
    )
    for decoy_first in (True, False):
        pairs = [
            (MetadataIndex("step", ()), _StorageInfo("decoy.distcp", 1, 2)),
            (MetadataIndex("step"), _StorageInfo("real.distcp", 10, 20)),
            (MetadataIndex("loss"), _StorageInfo("decoy.distcp", 3, 4)),
            (MetadataIndex("loss", ()), _StorageInfo("real.distcp", 30, 40)),
        ]
        storage = dict(pairs if decoy_first else pairs[::-1])
        md = Metadata({"step": BytesStorageMetadata(), "loss": scalar}, storage_data=storage, planner_data={})
        data = pickle.dumps(md, protocol=4)
        assert differential.differences(data) == []
        got = differential.ours(data)["generic"]
        assert got["step"][3][0][2][0] == "real.distcp" and got["loss"][3][0][2][0] == "real.distcp"


@pytest.mark.parametrize("opcode", [b"B", b"C", b"\x8e"])
def test_a_position_inside_an_argument_is_not_an_opcode_start(opcode: bytes) -> None:
    """The walk that proves a run of the bulk parse: record-shaped bytes inside a length-prefixed
    argument are not where the unpickler executes opcodes."""
    inner = b"K\x01K\x02\x86\x94"
    width = {b"B": "<I", b"C": "<B", b"\x8e": "<Q"}[opcode]
    stream = b"\x80\x04" + opcode + struct.pack(width, len(inner)) + inner + b"0N."
    start = 2 + 1 + struct.calcsize(width)
    assert pickle.loads(stream) is None
    assert not lands_on(stream, [start])
    assert not lands_on(stream, [start + 2])
    assert lands_on(stream, [2, start + len(inner), start + len(inner) + 1])
    assert not lands_on(stream, [len(stream) + 1])  # past the end
    assert not lands_on(stream + b"K\x01", [len(stream) + 1])  # past the STOP
