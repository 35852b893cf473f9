"""State that frameworks keep beside a DCP's data, inside its directory, read as entries of the
checkpoint -- so that it is shown, compared and carried into every output like the rest.

* ``common.pt`` (Megatron-Core / NeMo ``torch_dist``): ``torch.save`` of the state every rank shares
  (iteration, args, ...), which Megatron's loader merges into the loaded state dict;
* ``metadata.json`` (Megatron-Core): the backends the checkpoint was saved with;
* ``meta.pt`` (Lightning's sharded checkpoints): ``torch.save`` of the non-tensor state (step,
  hyper-parameters).

Each sidecar's entries are named under its file's stem (``common.iteration``, ``meta.step``). The
``torch.save`` sidecars are read with the weights-only restricted unpickler (tensors in them are
tensors); one that cannot be read, or whose names are taken, is left out with a note saying so, as
is every other file in a framework's checkpoint directory that DCP Studio does not read: nothing
is dropped unsaid (:attr:`DCPWithSidecars.notes`, which conversions repeat)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from ...errors import DCPStudioError
from ...formats.dcp.files import METADATA_FILE
from ...io.files import member_path, read_regular
from ...pickles.refs import TensorRef
from ..base import Checkpoint, Region
from ..model import Chunk, Entry
from ..torchsave import TorchCheckpoint
from .nested import NestedDCPCheckpoint

__all__ = ["SIDECARS", "DCPWithSidecars", "sidecars_in"]

SIDECARS: dict[str, str] = {
    "common.pt": "Megatron-Core's common state",
    "metadata.json": "Megatron-Core's checkpoint config",
    "meta.pt": "Lightning's checkpoint metadata",
}
_JSON_LIMIT = 1 << 20


def sidecars_in(path: Any) -> list[str]:
    """The known sidecar files the local DCP directory ``path`` holds (a remote DCP opens with its
    ``.metadata`` alone: looking for them would cost a request each)."""
    return [name for name in SIDECARS if (path / name).is_file()] if isinstance(path, Path) else []


class _Json(Checkpoint):
    """A JSON sidecar: each top-level key a value."""

    def __init__(self, path: Any) -> None:
        try:
            obj = json.loads(read_regular(path, _JSON_LIMIT, str(path)))
        except (ValueError, UnicodeDecodeError) as e:
            raise DCPStudioError(f"not JSON ({e})") from e
        if not isinstance(obj, dict):
            raise DCPStudioError(f"holds a {type(obj).__name__}, not an object")
        super().__init__(path, {str(k): Entry(str(k), "object", value=v) for k, v in obj.items()})

    def chunks(self, fqn: str) -> list[Chunk]:
        return []

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        return self.entry(fqn).value


class DCPWithSidecars(NestedDCPCheckpoint):
    """A DCP whose directory holds a framework's sidecars (:data:`SIDECARS`): their entries follow the
    DCP's own, each read from its sidecar."""

    def __init__(self, path: Path, *, trust_pickle: bool = False, full_index: bool = False) -> None:
        super().__init__(path, trust_pickle=trust_pickle, full_index=full_index)
        self._own = dict(self.entries)
        self._sides: list[Checkpoint] = []
        self._owner: dict[str, tuple[Checkpoint, str]] = {}
        self._side_paths: dict[str, tuple[str | int, ...]] = {}
        self.notes: list[str] = []
        try:
            for name in sidecars_in(path):
                self._add(name, trust_pickle)
            self._unread(path)
        except BaseException:
            self.close()
            raise
        self.info["notes"] = tuple(self.notes)

    def _add(self, name: str, trust: bool) -> None:
        file = member_path(self.path, name, SIDECARS[name])
        group = name.rsplit(".", 1)[0]
        try:
            side: Checkpoint = _Json(file) if name.endswith(".json") else TorchCheckpoint(file, trust_pickle=trust)
        except DCPStudioError as e:
            self.notes.append(f"{name} ({SIDECARS[name]}) was not carried: {str(e).removeprefix(f'{file}: ')}")
            return
        names = {inner: f"{group}.{inner}" for inner in side.entries}
        taken = sorted(set(names.values()) & set(self.entries))
        if taken:
            side.close()
            self.notes.append(f"{name} ({SIDECARS[name]}) was not carried: its name {taken[0]!r} is taken")
            return
        self._sides.append(side)
        paths = side.paths()
        for inner, entry in side.entries.items():
            fqn = names[inner]
            shared = tuple(names.get(n, n) for n in entry.shared_with)
            self.entries[fqn] = dataclasses.replace(entry, fqn=fqn, shared_with=shared)
            self._owner[fqn] = (side, inner)
            self._side_paths[fqn] = (group, *paths.get(inner, (inner,)))

    def _unread(self, path: Any) -> None:
        """One note naming the files of the directory that are neither the DCP's (``.metadata``, data
        files ``*.distcp``) nor a sidecar read."""
        if not isinstance(path, Path):
            return
        known = {METADATA_FILE, *SIDECARS}
        other = sorted(
            p.name + ("/" if p.is_dir() else "")
            for p in path.iterdir()
            if p.name not in known and not (p.suffix == ".distcp" and p.is_file())
        )
        if other:
            shown = ", ".join(other[:8]) + (", ..." if len(other) > 8 else "")
            self.notes.append(f"not carried (files DCP Studio does not read): {shown}")

    def own_entries(self) -> dict[str, Entry]:
        own: dict[str, Entry] | None = getattr(self, "_own", None)  # None while the DCP itself opens
        return self.entries if own is None else own

    def _side(self, fqn: str) -> tuple[Checkpoint, str] | None:
        return self._owner.get(fqn)

    def paths(self) -> dict[str, tuple[str | int, ...]]:
        return {**super().paths(), **self._side_paths}

    def chunks(self, fqn: str) -> list[Chunk]:
        side = self._side(fqn)
        return super().chunks(fqn) if side is None else side[0].chunks(side[1])

    def chunk_count(self, fqn: str) -> int:
        side = self._side(fqn)
        return super().chunk_count(fqn) if side is None else side[0].chunk_count(side[1])

    def resolve_chunks(self, fqn: str) -> list[Chunk]:
        side = self._side(fqn)
        return super().resolve_chunks(fqn) if side is None else side[0].resolve_chunks(side[1])

    def tensor_ref(self, fqn: str) -> TensorRef:
        side = self._side(fqn)
        return super().tensor_ref(fqn) if side is None else side[0].tensor_ref(side[1])

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        side = self._side(fqn)
        return super().read_object(fqn, limit) if side is None else side[0].read_object(side[1], limit)

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        side = self._side(fqn)
        return super().read_tensor(fqn, region) if side is None else side[0].read_tensor(side[1], region)

    def reads_in_place(self, fqn: str) -> bool:
        side = self._side(fqn)
        return super().reads_in_place(fqn) if side is None else side[0].reads_in_place(side[1])

    def read_into(self, fqn: str, region: Region | None, out: torch.Tensor) -> None:
        side = self._side(fqn)
        if side is None:
            super().read_into(fqn, region, out)
        else:
            side[0].read_into(side[1], region, out)

    def close(self) -> None:
        for side in getattr(self, "_sides", ()):
            side.close()
        super().close()
