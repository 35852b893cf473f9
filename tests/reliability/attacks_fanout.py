"""Fan-out disk bombs (issue 24, item 5): one small storage viewed under many names, so that every
name passes the per-entry expansion check while the output, written name by name, is many times
the file. Each must be refused by the total output bound wherever the target writes views out
(DCP, safetensors); a torch.save target keeps the storage shared, so it may succeed, small."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.reliability.attacks import Attack, edit_metadata

_MIB = 1 << 20


def _size(rng: random.Random) -> tuple[int, int]:
    """How many names view one storage of how many floats: 2 GiB and more written out, and a
    ``verify`` of the file against itself (which reads every name) still quick."""
    return rng.choice([(128, 16 * _MIB // 4), (1024, 2 * _MIB // 4), (1024, 4 * _MIB // 4)])


def torch_fanout(work: Path, rng: random.Random) -> Attack:
    """A torch.save file whose one storage (16 MiB, or 2-4 MiB) is viewed under 128 (or 1,024)
    names -- whole, reshaped, sliced, and strided: transposed, permuted, with gaps (read through a
    bounded window of the storage, never the whole storage per name) -- plus honest entries: 2-4
    GiB when written out name by name."""
    import torch

    names, numel = _size(rng)
    storage = torch.arange(numel, dtype=torch.float32)
    views = [
        lambda: storage,
        lambda: storage.view(1024, -1),
        lambda: storage[: numel - rng.randrange(1, 1024)],
        lambda: storage.view(1024, -1).t(),
        lambda: storage[:: rng.choice([2, 3, 5])],
        lambda: storage.view(64, 64, -1).permute(2, 0, 1),
        lambda: storage.view(1024, -1)[1::2, :: rng.choice([2, 7])],
    ]
    state: dict[str, Any] = {f"layer.{i}.w": rng.choice(views)() for i in range(names)}
    state["head"] = torch.arange(8.0)
    state["step"] = 3
    path = work / "fanout.pt"
    torch.save(state, path)
    return Attack(path, frozenset({"to-dcp", "to-safetensors"}), secret=None, note=f"{names} x {numel * 4} B")


def dcp_fanout(work: Path, rng: random.Random) -> Attack:
    """A DCP whose ``.metadata`` declares 128 (or 1,024) more tensors whose storage records are all
    the one record of a single saved tensor (torch's ``dcp.load`` reads each of them from it)."""
    import torch

    from dcpstudio.core import torch_save_to_dcp

    names, numel = _size(rng)
    pt = work / "one.pt"
    torch.save({"w": torch.zeros(numel), "step": 1}, pt)
    ckpt = work / "ckpt"
    torch_save_to_dcp(pt, ckpt)
    pt.unlink()

    def edit(md: Any) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        (key,) = [k for k in md.storage_data if k.fqn == "w"]
        info = md.storage_data[key]
        for i in range(names):
            fqn = f"copy.{i}"
            md.state_dict_metadata[fqn] = md.state_dict_metadata["w"]
            md.storage_data[MetadataIndex(fqn, key.offset)] = info
            if isinstance(md.planner_data, dict):
                md.planner_data[fqn] = ("copy", str(i))

    edit_metadata(ckpt, edit)
    return Attack(
        ckpt, frozenset({"to-dcp", "to-torch", "to-safetensors"}), secret=None, note=f"{names} x {numel * 4} B"
    )


ATTACKS_FANOUT: dict[str, Callable[[Path, random.Random], Attack]] = {
    "torch-fanout": torch_fanout,
    "dcp-fanout": dcp_fanout,
}
