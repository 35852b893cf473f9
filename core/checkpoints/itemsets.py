"""A torchtitan ``torch_checkpointing`` checkpoint folder -- per top-level item and rank one
``torch.save`` file, ``<item>_<rank>.pt`` (``model_0.pt``, ``model_1.pt``, ``optimizer_0.pt``,
``step_0.pt`` ...), and, when the items declare a resharder (as torchtitan's backend does),
``metadata.pkl`` from rank 0 -- read as one checkpoint whose top-level groups are the items.

Each item's rank files are one :class:`~.shardset.ShardSetCheckpoint` (DTensor shards assembled,
plain values from the lowest rank), its names prefixed ``<item>.``; an item saved as a bare value
(``step_0.pt`` holding ``3``) is the entry ``<item>``. ``metadata.pkl`` is a plain pickle of the
package's resharding metadata (``pickle.loads`` is how the package reads it, so it is never
opened here): the rank files' own DTensor placements say everything it does, and a note names it
as not carried. A folder where an item lacks a rank the others have is refused in one line.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ..errors import CorruptCheckpointError
from ..formats.detect import Format
from ..pickles.refs import TensorRef
from .base import ROOT_KEY, Checkpoint, Region
from .model import Chunk, Entry
from .shardset import ShardSetCheckpoint

__all__ = ["METADATA_FILE", "ItemSetCheckpoint", "item_set_files"]

METADATA_FILE = "metadata.pkl"
_ITEM_FILE = re.compile(r"^(?P<item>.+?)_(?P<rank>\d+)\.pt$")


def item_set_files(path: Path) -> dict[str, list[Path]] | None:
    """Each item's rank files, in rank order, when ``path`` holds nothing but ``<item>_<rank>.pt``
    files (and ``metadata.pkl``) of two or more items, or of one item beside ``metadata.pkl``;
    None otherwise. Raises when an item lacks one of the ranks 0 .. N-1 the folder holds."""
    if not path.is_dir():
        return None
    found: dict[str, dict[int, Path]] = {}
    metadata = False
    for p in path.iterdir():
        if p.name.startswith(".") or not p.is_file():
            continue
        m = _ITEM_FILE.match(p.name)
        if p.name == METADATA_FILE:
            metadata = True
        elif m is None:
            return None
        else:
            found.setdefault(m["item"], {})[int(m["rank"])] = p
    if not found or (len(found) < 2 and not metadata):
        return None
    world = max(r for ranks in found.values() for r in ranks) + 1
    for item, ranks in sorted(found.items()):
        missing = [r for r in range(world) if r not in ranks]
        if missing:
            raise CorruptCheckpointError(
                f"{path}: item {item!r} of this torch_checkpointing folder lacks rank {missing[0]} "
                f"({item}_{missing[0]}.pt); the folder holds ranks 0 to {world - 1}"
            )
    return {item: [ranks[r] for r in range(world)] for item, ranks in sorted(found.items())}


class ItemSetCheckpoint(Checkpoint):
    """The items of :func:`item_set_files` as one checkpoint: ``<item>.<name>`` entries."""

    format: Format = "torch"

    def __init__(self, path: Path, items: dict[str, list[Path]], *, trust_pickle: bool = False) -> None:
        self._items: list[ShardSetCheckpoint] = []
        self._owner: dict[str, tuple[ShardSetCheckpoint, str]] = {}
        self._paths: dict[str, tuple[str | int, ...]] = {}
        entries: dict[str, Entry] = {}
        try:
            for item, files in items.items():
                part = ShardSetCheckpoint(path, files, trust_pickle=trust_pickle, require_dtensor=False)
                self._items.append(part)
                names = {inner: item if inner == ROOT_KEY else f"{item}.{inner}" for inner in part.entries}
                inner_paths = part.paths()
                for inner, entry in part.entries.items():
                    fqn = names[inner]
                    shared = tuple(names.get(n, n) for n in entry.shared_with)
                    entries[fqn] = dataclasses.replace(entry, fqn=fqn, shared_with=shared)
                    self._owner[fqn] = (part, inner)
                    tail = () if inner == ROOT_KEY else inner_paths.get(inner, (inner,))
                    self._paths[fqn] = (item, *tail)
        except BaseException:
            self.close()
            raise
        notes = []
        if (path / METADATA_FILE).is_file():
            notes.append(
                f"{METADATA_FILE} (torch_checkpointing's resharding metadata, a pickle) was not carried; "
                "the rank files' DTensor placements were read instead"
            )
        info = {"format": "torch_checkpointing", "ranks": len(next(iter(items.values()))), "notes": tuple(notes)}
        super().__init__(path, entries, info)

    def _side(self, fqn: str) -> tuple[ShardSetCheckpoint, str]:
        return self._owner[self.entry(fqn).fqn]

    def paths(self) -> dict[str, tuple[str | int, ...]]:
        return dict(self._paths)

    def chunks(self, fqn: str) -> list[Chunk]:
        part, inner = self._side(fqn)
        return part.chunks(inner)

    def chunk_count(self, fqn: str) -> int:
        part, inner = self._side(fqn)
        return part.chunk_count(inner)

    def resolve_chunks(self, fqn: str) -> list[Chunk]:
        part, inner = self._side(fqn)
        return part.resolve_chunks(inner)

    def tensor_ref(self, fqn: str) -> TensorRef:
        part, inner = self._side(fqn)
        return part.tensor_ref(inner)

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        part, inner = self._side(fqn)
        return part.read_object(inner, limit)

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        part, inner = self._side(fqn)
        return part.read_tensor(inner, region)

    def reads_in_place(self, fqn: str) -> bool:
        part, inner = self._side(fqn)
        return part.reads_in_place(inner)

    def read_into(self, fqn: str, region: Region | None, out: torch.Tensor) -> None:
        part, inner = self._side(fqn)
        part.read_into(inner, region, out)

    def read_value(self, fqn: str) -> Any:
        part, inner = self._side(fqn)
        return part.read_value(inner)

    def close(self) -> None:
        for part in getattr(self, "_items", ()):
            part.close()
