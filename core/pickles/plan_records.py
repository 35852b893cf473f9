"""DCP's save-plan classes, as a ``.metadata`` may hold them: Megatron-Core and NeMo (``torch_dist``)
set ``Metadata.all_local_plans`` to every rank's ``SavePlan`` so that a later save can check its
cached plan. Nothing DCP Studio reads depends on them; they are admitted to the ``.metadata``
allow-list so that those checkpoints open by default, read as plain records (:mod:`._pickle`'s
``LightRecord``) -- torch's own classes are never built from a checkpoint's bytes."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError

__all__ = ["PLANNER_CLASSES", "WriteItemKind"]

_PLANNER = "torch.distributed.checkpoint.planner"
PLANNER_CLASSES: tuple[tuple[str, str], ...] = (
    (_PLANNER, "SavePlan"),
    (_PLANNER, "WriteItem"),
    (_PLANNER, "TensorWriteData"),
    (_PLANNER, "BytesIOWriteData"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
)


class WriteItemKind(int):
    """A member of DCP's ``WriteItemType`` enum (1 tensor, 2 shard, 3 bytes), pickled as
    ``WriteItemType(value)``; any other value is refused, as the enum itself refuses it."""

    torch_global = (_PLANNER, "WriteItemType")

    def __new__(cls, value: Any) -> WriteItemKind:
        if type(value) is not int or value not in (1, 2, 3):
            raise CorruptCheckpointError(f"WriteItemType({str(value)[:20]}) is not a DCP write item type")
        return super().__new__(cls, value)

    def __reduce__(self) -> Any:
        return (WriteItemKind, (int(self),))
