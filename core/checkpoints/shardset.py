"""A per-rank torch.save shard set -- a folder of ``model_0.pt`` ... ``model_{N-1}.pt``, each rank's
``torch.save`` of its state dict of DTensors (FSDP2, tensor parallel) -- read as one checkpoint.

Each rank file is a :class:`~.torchsave.TorchCheckpoint`, whose DTensors are their local shards,
placed by their mesh and placements (:mod:`dcpstudio.core.pickles.dtensor`). Here the shards of one
name become the chunks of one full tensor, as DCP's are: replicas stored once, the rest checked
to tile the global shape exactly. Plain values and plain tensors are taken once, from the lowest
rank that holds them -- what ``dcp.save`` of the same state dicts stores (a set of rank files with
no DTensor at all is refused unless ``require_dtensor=False``: a folder of one item's per-rank
values, :mod:`.itemsets`). A set that is not whole
(a rank missing, shards that disagree on the global shape) is refused in one line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ..errors import CorruptCheckpointError
from ..formats.dcp.files import check_tiling
from ..formats.detect import Format
from ..io.buffers import new_tensor
from ..pickles.refs import StorageRef, TensorRef
from .base import Checkpoint, Region, _box, _overlaps, _place
from .model import Chunk, Entry, dtype_name, relative
from .torchsave import TorchCheckpoint

__all__ = ["ShardSetCheckpoint", "shard_set_files"]

_RANK_FILE = re.compile(r"^(?P<stem>.*?)(?P<rank>\d+)(?P<ext>\.(?:pt|pth|bin))$")


def shard_set_files(path: Path) -> list[Path] | None:
    """The rank files of a folder that holds nothing but ``<stem><rank>.pt`` files of one stem
    (two or more), in rank order; None when ``path`` is not such a folder. Raises when the
    ranks are not 0 .. N-1."""
    if not path.is_dir():
        return None
    found: dict[int, Path] = {}
    stems = set()
    for p in path.iterdir():
        if p.name.startswith(".") or not p.is_file():
            continue
        m = _RANK_FILE.match(p.name)
        if m is None:
            return None
        stems.add((m["stem"], m["ext"]))
        found[int(m["rank"])] = p
    if len(found) < 2 or len(stems) != 1:
        return None
    missing = [r for r in range(max(found) + 1) if r not in found]
    if missing:
        stem, ext = next(iter(stems))
        raise CorruptCheckpointError(
            f"{path}: a per-rank shard set without rank {missing[0]} ({stem}{missing[0]}{ext}); "
            f"it holds ranks {sorted(found)}"
        )
    return [found[r] for r in range(len(found))]


class ShardSetCheckpoint(Checkpoint):
    """The rank files of :func:`shard_set_files` as one checkpoint of full tensors."""

    format: Format = "torch"

    def __init__(
        self, path: Path, files: list[Path], *, trust_pickle: bool = False, require_dtensor: bool = True
    ) -> None:
        self._require_dtensor = require_dtensor
        self._ranks: list[TorchCheckpoint] = []
        try:
            for f in files:
                self._ranks.append(TorchCheckpoint(f, trust_pickle=trust_pickle))
            entries, self._parts = self._assemble(path)
        except BaseException:
            self.close()
            raise
        info = {"format": self._ranks[0].info.get("format", "torch-zip"), "ranks": len(files)}
        super().__init__(path, entries, info)

    def _assemble(self, path: Path) -> tuple[dict[str, Entry], dict[str, list[tuple[int, tuple[int, ...]]]]]:
        """Each name's entry and its parts: (rank, offsets in the global tensor) per stored shard."""
        world = len(self._ranks)
        entries: dict[str, Entry] = {}
        parts: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
        seen_dtensor = False
        for rank, ck in enumerate(self._ranks):
            name = Path(ck.label).name
            for fqn, e in ck.entries.items():
                placed = ck.placed.get(fqn)
                if placed is None:
                    if fqn in parts and fqn in self._ranks[parts[fqn][0][0]].placed:
                        raise CorruptCheckpointError(
                            f"{path}: {name} holds {fqn!r} as a plain value, an earlier rank as a DTensor"
                        )
                    if fqn not in entries:
                        entries[fqn] = e
                        parts[fqn] = [(rank, (0,) * len(e.shape or ()))]
                    continue
                seen_dtensor = True
                dt, offsets = placed
                if dt.world > world:
                    raise CorruptCheckpointError(
                        f"{path}: {fqn!r} is sharded over a {dt.world}-rank mesh, but the set has {world} rank files; "
                        f"the files of ranks {world} to {dt.world - 1} are missing"
                    )
                if dt.rank != rank:
                    raise CorruptCheckpointError(
                        f"{path}: {name} holds rank {dt.rank}'s shard of {fqn!r}; "
                        "each rank's file must be named by its rank"
                    )
                first = entries.get(fqn)
                if first is None:
                    entries[fqn] = Entry(fqn, "tensor", dt.dtype, dt.shape)
                    parts[fqn] = []
                elif (
                    first.shape != dt.shape
                    or first.dtype is not dt.dtype
                    or fqn not in self._ranks[parts[fqn][0][0]].placed
                ):
                    raise CorruptCheckpointError(
                        f"{path}: {name} holds {fqn!r} as {dtype_name(dt.dtype)} {list(dt.shape)}, an earlier rank as "
                        f"{dtype_name(first.dtype)} {list(first.shape or ())}"
                    )
                if all(o != offsets for _, o in parts[fqn]):
                    parts[fqn].append((rank, offsets))
        if not seen_dtensor and self._require_dtensor:
            raise CorruptCheckpointError(
                f"{path}: {world} torch.save files named by rank, but none holds a DTensor shard; "
                "open them one at a time"
            )
        for fqn, found in parts.items():
            if fqn in self._ranks[found[0][0]].placed:
                shape = entries[fqn].shape or ()
                boxes = [(o, self._ranks[r].entries[fqn].shape or ()) for r, o in found]
                check_tiling(shape, boxes, f"{path} ({fqn!r})")
        return entries, parts

    def _owner(self, fqn: str) -> TorchCheckpoint:
        return self._ranks[self._parts[self.entry(fqn).fqn][0][0]]

    def _whole(self, fqn: str) -> bool:
        """Stored whole in one rank file (a plain value or tensor, or a replicated DTensor)."""
        found = self._parts[fqn]
        return len(found) == 1 and self._ranks[found[0][0]].entries[fqn].shape == self.entries[fqn].shape

    def paths(self) -> dict[str, tuple[str | int, ...]]:
        out: dict[str, tuple[str | int, ...]] = {}
        for fqn in self.entries:
            out[fqn] = self._owner(fqn).paths()[fqn]
        return out

    def chunk_count(self, fqn: str) -> int:
        return len(self._parts[self.entry(fqn).fqn]) if self.entry(fqn).kind == "tensor" else 0

    def chunks(self, fqn: str) -> list[Chunk]:
        if self.entry(fqn).kind != "tensor":
            return []
        out = []
        for rank, offsets in self._parts[fqn]:
            for c in self._ranks[rank].chunks(fqn):
                file = relative(self.path / str(c.file), self.path) if c.file else None
                out.append(Chunk(offsets, c.sizes, file, c.offset, c.length, c.data_offset))
        return out

    def tensor_ref(self, fqn: str) -> TensorRef:
        if self._whole(self.tensor_entry(fqn).fqn):
            return self._owner(fqn).tensor_ref(fqn)
        return super().tensor_ref(fqn)

    def storage_bytes(self, ref: StorageRef) -> memoryview:
        return super().storage_bytes(ref)

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        entry = self.tensor_entry(fqn)
        if self._whole(fqn):
            return self._owner(fqn).read_tensor(fqn, region)
        offsets, sizes = _box(entry, region)
        assert entry.dtype is not None
        out = new_tensor(sizes, entry.dtype.torch)  # the shards tile it (checked on opening)
        found = self._parts[fqn]
        tiles = [(o, self._ranks[r].entries[fqn].shape or ()) for r, o in found]
        for k, local, size, at in _overlaps(offsets, sizes, tiles):
            piece = self._ranks[found[k][0]].read_tensor(
                fqn, [slice(a, a + n) for a, n in zip(local, size, strict=True)]
            )
            _place(out, at, piece)
        return out

    def reads_in_place(self, fqn: str) -> bool:
        found = self._parts.get(self.entry(fqn).fqn, [])
        return self.entry(fqn).kind == "tensor" and all(self._ranks[r].reads_in_place(fqn) for r, _ in found)

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        return self._owner(fqn).read_object(fqn, limit)

    def read_value(self, fqn: str) -> Any:
        if self.entry(fqn).kind == "tensor":
            return self.read_tensor(fqn)
        return self._owner(fqn).read_value(fqn)

    def close(self) -> None:
        for ck in self._ranks:
            ck.close()
