"""What a conversion does to its source's entries -- which it keeps, what it renames them, which
dtype it casts them to -- and the source seen through it.

:class:`Transform` is the one place these rules live: :func:`~.convert.convert` writes with it and
:func:`~..verify.verify` reads the source through it (:class:`Transformed`), so an output is checked
against exactly what its conversion meant to write, not against the whole, uncast source. Nothing
is recorded in the outputs, so the same options are given again (the CLI's flags mirror convert's;
the window keeps those of its last conversion in the :class:`~.output.ConversionResult`).
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from ...checkpoints import Checkpoint, Region
from ...checkpoints.model import Node, build_tree
from ...dtypes import DTYPES, DType
from ...errors import DCPStudioError
from ...pickles.refs import StorageRef, TensorRef
from ...pickles.tensor_io import materialize, to_bytes
from .names import NameFilter

if TYPE_CHECKING:
    import torch

__all__ = ["CASTS", "Transform", "Transformed", "cast_ref", "cast_view"]

CASTS = {"bf16": DTYPES["bfloat16"], "fp16": DTYPES["float16"], "fp32": DTYPES["float32"]}
"""The casts a conversion offers, by the name the CLI and the window give them."""


@dataclass(frozen=True)
class Transform:
    """``include``/``exclude``: regular expressions searched in names (:class:`~.names.NameFilter`);
    ``dtype``: the cast of floating-point tensors (a key of :data:`CASTS`); ``strip_prefix``: a
    prefix dropped from the names that start with it (safetensors outputs only)."""

    include: str | None = None
    exclude: str | None = None
    dtype: Literal["bf16", "fp16", "fp32"] | None = None
    strip_prefix: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in CASTS:
            raise ValueError(f"unknown dtype {self.dtype!r} (expected bf16, fp16 or fp32)")
        NameFilter(self.include, self.exclude)  # a bad pattern is refused when the transform is made

    @property
    def identity(self) -> bool:
        return self == Transform()

    @functools.cached_property
    def keep(self) -> NameFilter:
        return NameFilter(self.include, self.exclude)

    def cast_of(self, dtype: DType) -> DType | None:
        """The dtype a tensor of ``dtype`` is written as, when it is cast (None: written as is). Packed
        floats (``float4_e2m1fn_x2``: torch has no cast from them) are written as they are."""
        to = CASTS[self.dtype] if self.dtype else None
        return to if to is not None and dtype.is_floating_point and dtype.pack == 1 and dtype is not to else None

    def rename(self, fqn: str) -> str:
        p = self.strip_prefix
        return fqn[len(p) :] if p and fqn.startswith(p) else fqn

    def flags(self) -> str:
        """The transform as the command-line options that make it (``--include '^model\\.' --dtype bf16``)."""
        parts = [
            f"--{f.name.replace('_', '-')} {shlex.quote(getattr(self, f.name))}"
            for f in fields(self)
            if getattr(self, f.name) is not None
        ]
        return " ".join(parts)


class Transformed(Checkpoint):
    """``source`` as a conversion with ``transform`` writes it: only the kept entries, under their
    new names, floating-point tensors cast with torch's own ``Tensor.to`` (what the conversion
    computes, so an output written with the cast equals this bit for bit). Two names that become
    one are refused, as the conversion refuses them."""

    def __init__(self, source: Checkpoint, transform: Transform, allow_empty: bool = False) -> None:
        transform.keep.check(source.entries, allow_empty=allow_empty)
        self.source = source
        self.transform = transform
        self.original: dict[str, str] = {}
        entries = {}
        for fqn, entry in source.entries.items():
            if not transform.keep(fqn):
                continue
            name = transform.rename(fqn)
            if name in self.original:
                raise DCPStudioError(f"{fqn} and {self.original[name]} both become {name!r}; adjust --strip-prefix")
            self.original[name] = fqn
            cast = transform.cast_of(entry.dtype) if entry.kind == "tensor" and entry.dtype else None
            entries[name] = replace(entry, fqn=name, dtype=cast or entry.dtype)
        super().__init__(source.path, entries, source.info)
        self.format = source.format
        self.label = source.label

    @functools.cached_property
    def tree(self) -> Node:
        self.source.tree  # noqa: B018 - the source's whole structure is checked (a DCP's storage index too)
        return build_tree(self.entries, self.path.name)

    def paths(self) -> dict[str, tuple[str | int, ...]]:
        paths = self.source.paths()
        return {name: paths.get(fqn, (name,)) if name == fqn else (name,) for name, fqn in self.original.items()}

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        self.entry(fqn)
        return self.source.read_object(self.original[fqn], limit)

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        entry = self.tensor_entry(fqn)
        t = self.source.read_tensor(self.original[fqn], region)
        assert entry.dtype is not None
        return t.to(entry.dtype.torch) if t.dtype != entry.dtype.torch else t

    def close(self) -> None:
        """The source is the caller's to close."""


class _Cast:
    """The storage of a tensor cast to another dtype: its bytes are computed (with torch) when
    they are written."""

    def __init__(self, source: TensorRef, to: DType, label: str) -> None:
        self.source = source
        self.to = to
        self.label = label

    def storage_range(self, ref: StorageRef) -> None:
        return None

    def storage_bytes(self, ref: StorageRef) -> memoryview:
        return to_bytes(materialize(self.source).to(self.to.torch))


def cast_ref(t: TensorRef, to: DType, label: str) -> TensorRef:
    """``t`` cast to ``to``, as a contiguous tensor whose bytes are computed when written."""
    storage = StorageRef.for_tensor(f"cast:{label}", to, t.numel, _Cast(t, to, label))
    return TensorRef.contiguous(storage, to, t.shape)


def cast_view(t: TensorRef, to: DType, label: str, done: dict[tuple[int, str], StorageRef]) -> TensorRef | None:
    """``t`` as the same view of its storage cast whole to ``to`` (once per storage and dtype, in
    ``done``): a torch.save target keeps views that share a storage sharing one. None when the
    storage does not hold whole elements of ``t``'s dtype."""
    src = t.storage
    if src is None or src.nbytes % t.dtype.itemsize:
        return None
    key = (id(src), t.dtype.name)
    storage = done.get(key)
    if storage is None:
        whole = TensorRef(src, t.dtype, (src.nbytes // t.dtype.itemsize,), (1,))
        storage = done[key] = StorageRef.for_tensor(f"cast:{label}", to, whole.numel, _Cast(whole, to, label))
    return TensorRef(storage, to, t.shape, t.stride, t.storage_offset, t.requires_grad)
