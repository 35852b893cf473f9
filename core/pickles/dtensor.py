"""DTensors in torch.save pickles, read as torch's weights-only loader admits them -- without torch.

``torch.save`` of a state dict of DTensors (each rank of an FSDP2 or tensor-parallel job saving
``model_{rank}.pt``) pickles every DTensor as a wrapper subclass: its global dtype, shape and stride,
then a state holding ``_local_tensor`` (this rank's shard, a plain tensor) and ``_spec`` (a
``DTensorSpec``: the ``DeviceMesh``, the placements -- ``Shard``, ``_StridedShard``, ``Replicate``,
``Partial`` -- a ``TensorMeta`` and the shard order). torch's ``weights_only`` loader admits exactly
these classes once ``torch.distributed.tensor`` is imported. Here each becomes a record that only
holds its pickled fields (:class:`Record`); :class:`DTensorRef` checks them and computes where the
rank's shard lies in the global tensor (:meth:`DTensorRef.box`), as
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` does, so the shards of a
set of rank files can be assembled like DCP chunks. Nothing here builds a torch object.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from ..dtypes import DType
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from .refs import TensorRef

__all__ = ["DTENSOR_GLOBALS", "DTensorRef", "DTensorType", "is_dtensor_class", "local_indices"]

_MAX_WORLD = 1 << 20


class Record:
    """One of the classes a DTensor's pickle names: its ``NEWOBJ`` arguments (``args``) and its
    ``BUILD`` state (``fields``), kept as plain data and read by :class:`DTensorRef` only."""

    torch_name = ""
    args: tuple[Any, ...]
    fields: dict[str, Any]

    def __new__(cls, *args: Any) -> Record:
        self = object.__new__(cls)
        self.args = args
        self.fields = {}
        return self

    def __setstate__(self, state: Any) -> None:
        pair = isinstance(state, tuple) and len(state) == 2  # (dict state, slots state)
        parts = [s for s in state if s is not None] if pair else [state]
        for part in parts:
            if not isinstance(part, dict):
                raise CorruptCheckpointError(f"damaged {self.torch_name} state in pickle")
            self.fields.update(part)

    def __reduce__(self) -> Any:
        raise UnsupportedFormatError(f"a {self.torch_name} cannot be written back; DCP Studio writes plain tensors")


def _record(module: str, name: str) -> type[Record]:
    return type(name.lstrip("_"), (Record,), {"__module__": __name__, "torch_name": f"{module}.{name}"})


class DTensorType:
    """``torch.distributed.tensor.DTensor`` as a type argument of the wrapper-subclass rebuild."""

    def __new__(cls, *args: Any) -> Any:
        raise CorruptCheckpointError("builds a DTensor directly (torch pickles it through _rebuild_wrapper_subclass)")


_PT = "torch.distributed.tensor.placement_types"
_SPEC = "torch.distributed.tensor._dtensor_spec"
_MESH_LAYOUT = "torch.distributed._mesh_layout"
_CLASSES = {
    key: _record(*key)
    for key in [
        ("torch.distributed.device_mesh", "DeviceMesh"),
        (_MESH_LAYOUT, "_MeshLayout"),
        (_MESH_LAYOUT, "_FlatLayout"),
        (_SPEC, "DTensorSpec"),
        (_SPEC, "TensorMeta"),
        (_SPEC, "ShardOrderEntry"),
        (_PT, "Shard"),
        (_PT, "_StridedShard"),
        (_PT, "Replicate"),
        (_PT, "Partial"),
    ]
}
DTENSOR_GLOBALS: dict[tuple[str, str], Any] = {("torch.distributed.tensor", "DTensor"): DTensorType, **_CLASSES}


def is_dtensor_class(cls: Any) -> bool:
    return cls is DTensorType


def _is(obj: Any, name: str) -> TypeGuard[Record]:
    return isinstance(obj, Record) and obj.torch_name.endswith("." + name)


def _int(value: Any, what: str, low: int = 0, high: int = 1 << 62) -> int:
    if type(value) is not int or not low <= value < high:
        raise CorruptCheckpointError(f"DTensor {what} is {str(value)[:40]!r}")
    return value


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > 64:
        raise CorruptCheckpointError(f"DTensor {what} is not a short tuple of integers")
    return tuple(_int(v, what) for v in value)


def _flat_size(layout: Any) -> int:
    """The number of ranks one mesh dimension spans (its layout's shape, flattened)."""
    shape = layout.fields.get("shape") if _is(layout, "_FlatLayout") else None
    if not isinstance(shape, (tuple, list)):
        raise CorruptCheckpointError("DTensor mesh layout has no shape")
    n = 1
    stack = list(shape)
    while stack:
        v = stack.pop()
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        else:
            n *= _int(v, "mesh size", 1, _MAX_WORLD)
    return n


def _placement(p: Any, ndim: int) -> tuple[Any, ...]:
    """``("S", dim)``, ``("SS", dim, split_factor)``, ``("R",)`` or ``("P",)``."""
    if _is(p, "Replicate"):
        return ("R",)
    if _is(p, "Partial"):
        return ("P",)
    if _is(p, "_StridedShard"):
        return (
            "SS",
            _int(p.fields.get("dim"), "shard dim", 0, max(ndim, 1)),
            _int(p.fields.get("split_factor"), "split factor", 1),
        )
    if _is(p, "Shard"):
        return ("S", _int(p.fields.get("dim"), "shard dim", 0, max(ndim, 1)))
    raise CorruptCheckpointError(f"DTensor placement of type {type(p).__name__}")


def _chunk(indices: Any, n: int, r: int) -> Any:
    """What ``torch.chunk`` gives rank ``r`` of ``n`` (as ``Shard`` splits: empty past the end)."""
    size = len(indices)
    step = -(-size // n)
    return indices[min(r * step, size) : min((r + 1) * step, size)]


def local_indices(
    size: int, placements: list[tuple[Any, ...]], mesh: tuple[int, ...], coord: tuple[int, ...], dim: int
) -> list[int] | range:
    """The global indices of dimension ``dim`` a rank at ``coord`` holds: placements applied left to
    right over the mesh dimensions, as torch's ``_compute_local_shape_and_global_offset`` does."""
    held: list[int] | range = range(size)
    for m, p in enumerate(placements):
        if p[0] == "S" and p[1] == dim:
            held = _chunk(held, mesh[m], coord[m])
        elif p[0] == "SS" and p[1] == dim:
            split = p[2]
            out: list[int] = []
            pieces = -(-len(held) // split)
            for k in range(split):
                piece = held[min(k * pieces, len(held)) : min((k + 1) * pieces, len(held))]
                out.extend(_chunk(piece, mesh[m], coord[m]))
            held = out
    return held


class DTensorRef:
    """A DTensor as a rank's torch.save file holds it: the global ``dtype``/``shape`` and this rank's
    shard (``local``, a :class:`TensorRef`) with the mesh and placements that say where it lies."""

    def __init__(self, dtype: Any, shape: Any, stride: Any, requires_grad: Any) -> None:
        if not isinstance(dtype, DType):
            raise CorruptCheckpointError(f"DTensor with element type {dtype!r}")
        self.dtype = dtype
        self.shape = _ints(shape, "size")
        self.stride = _ints(stride, "stride")
        self.requires_grad = bool(requires_grad)
        self.local: TensorRef | None = None
        self.placements: list[tuple[Any, ...]] = []
        self.mesh: tuple[int, ...] = ()
        self.coord: tuple[int, ...] = ()
        self.rank = 0

    def __setstate__(self, state: Any) -> None:
        """The ``(None, {"_local_tensor": ..., "_spec": ...})`` state torch pickles for a DTensor."""
        slots = state[1] if isinstance(state, tuple) and len(state) == 2 else state
        if not isinstance(slots, dict):
            raise CorruptCheckpointError("damaged DTensor state in pickle")
        local, spec = slots.get("_local_tensor"), slots.get("_spec")
        if not isinstance(local, TensorRef) or not _is(spec, "DTensorSpec"):
            raise CorruptCheckpointError("a DTensor without its local tensor or spec")
        if local.dtype is not self.dtype:
            raise CorruptCheckpointError(f"a {self.dtype} DTensor over a {local.dtype} local tensor")
        mesh = spec.fields.get("mesh")
        placements = spec.fields.get("placements")
        if not _is(mesh, "DeviceMesh") or not isinstance(placements, tuple):
            raise CorruptCheckpointError("a DTensor spec without its mesh or placements")
        layout = mesh.fields.get("_layout")
        axes = layout.fields.get("axes") if _is(layout, "_MeshLayout") else None
        if not isinstance(axes, tuple) or len(axes) != len(placements):
            raise CorruptCheckpointError("a DTensor mesh whose dimensions do not match its placements")
        self.mesh = tuple(_flat_size(a) for a in axes)
        self.coord = _ints(mesh.fields.get("_coordinate_on_dim"), "mesh coordinate")
        if len(self.coord) != len(self.mesh) or any(c >= n for c, n in zip(self.coord, self.mesh, strict=True)):
            raise CorruptCheckpointError(f"DTensor mesh coordinate {list(self.coord)} outside mesh {list(self.mesh)}")
        self.rank = _int(mesh.fields.get("_rank"), "rank", 0, _MAX_WORLD)
        self.placements = [_placement(p, len(self.shape)) for p in placements]
        self._check_order(spec.fields.get("shard_order"))
        self.local = local

    def _check_order(self, order: Any) -> None:
        """Only the default shard order (mesh dimensions left to right) is placed; torch writes it
        explicitly, one ``ShardOrderEntry(tensor_dim, mesh_dims)`` per sharded dimension."""
        for entry in order or ():
            if not _is(entry, "ShardOrderEntry") or len(entry.args) != 2:
                raise CorruptCheckpointError("damaged DTensor shard order")
            dim, mesh_dims = entry.args
            default = tuple(m for m, p in enumerate(self.placements) if p[0] in ("S", "SS") and p[1] == dim)
            if tuple(mesh_dims) != default:
                raise UnsupportedFormatError(
                    f"a DTensor sharded in a non-default order (tensor dim {dim} over mesh dims {list(mesh_dims)}); "
                    "DCP Studio places shards in mesh order only -- redistribute it before saving"
                )

    @property
    def world(self) -> int:
        n = 1
        for s in self.mesh:
            n *= s
        return n

    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where this rank's shard lies in the global tensor: ``(offsets, sizes)``, checked
        against the local tensor's shape."""
        assert self.local is not None
        if any(p[0] == "P" for p in self.placements):
            raise UnsupportedFormatError(
                "a DTensor with a Partial placement (a pending reduction): no file holds its value; "
                "reduce it (redistribute to Replicate) before saving"
            )
        offsets, sizes = [], []
        for dim, size in enumerate(self.shape):
            held = local_indices(size, self.placements, self.mesh, self.coord, dim)
            first = held[0] if len(held) else 0
            if list(held) != list(range(first, first + len(held))):
                raise UnsupportedFormatError(
                    f"a DTensor shard that is not one block of the tensor (placements {self.placements})"
                )
            offsets.append(first)
            sizes.append(len(held))
        if tuple(sizes) != self.local.shape:
            raise CorruptCheckpointError(
                f"a DTensor shard of shape {list(self.local.shape)} where its placements give {sizes}"
            )
        return tuple(offsets), tuple(sizes)

    def __reduce__(self) -> Any:
        raise UnsupportedFormatError("a DTensor inside a value cannot be written; DCP Studio writes plain tensors")

    def __repr__(self) -> str:
        return f"DTensorRef({self.dtype}, {list(self.shape)}, mesh {list(self.mesh)}, {self.placements})"
