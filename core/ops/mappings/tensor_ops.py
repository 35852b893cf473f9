"""The named per-tensor operations a mapping's rules chain: what each does to shapes (known
before any byte is read, so a plan is checked and shown up front) and to tensors (torch, when an
output is written), and its inverse (so one table serves both directions).

An operation takes the list of tensors flowing through a rule and returns the next list:
``permute``/``unpermute`` (the rotary q/k row order of Hugging Face's ``convert_llama_weights``,
exactly torchtitan's ``_permute``/``_reverse_permute``), ``transpose``, ``split``/``concat``
(fused QKV, gate-up), ``unstack``/``stack`` (grouped experts), ``cast`` and ``dequant_fp8``
(one way: no inverse). Arguments are concrete here; :mod:`.rules` evaluates them over the config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...dtypes import DTYPES, DType
from .expr import MappingError

if TYPE_CHECKING:
    import torch

__all__ = ["ONE_WAY", "OPS", "Meta", "Op", "apply_ops", "inverse_ops", "row_order", "shape_ops"]

Meta = tuple[tuple[int, ...], DType]  # a tensor's shape and dtype
_CAST_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}


@dataclass(frozen=True)
class Op:
    """One operation with its arguments (expressions in a rule; numbers once bound to a config)."""

    kind: str
    args: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.args.items())
        return f"{self.kind}({inner})" if inner else self.kind


def dtype_named(name: str) -> DType:
    key = _CAST_NAMES.get(name, name)
    if key not in DTYPES:
        raise MappingError(f"unknown dtype {name!r} (e.g. bfloat16, float16, float32)")
    return DTYPES[key]


def _one(metas: Sequence[Meta], op: Op) -> Meta:
    if len(metas) != 1:
        raise MappingError(f"{op.text()} takes one tensor, got {len(metas)}")
    return metas[0]


def _each(fn: Callable[[Sequence[Meta], Op], list[Meta]]) -> Callable[[Sequence[Meta], Op], list[Meta]]:
    """A one-tensor operation applied to every tensor of the list (a split's parts, each permuted)."""
    return lambda metas, op: [out for m in metas for out in fn([m], op)]


def _rows_by_heads(metas: Sequence[Meta], op: Op) -> list[Meta]:
    shape, dtype = _one(metas, op)
    heads = op.args["heads"]
    if len(shape) != 2:
        raise MappingError(f"{op.text()} needs a 2-D weight, got shape {list(shape)}")
    if heads <= 0 or shape[0] % heads or (shape[0] // heads) % 2:
        raise MappingError(f"{op.text()}: {shape[0]} rows are not {heads} heads of an even head_dim")
    return [(shape, dtype)]


def _transpose_shape(metas: Sequence[Meta], op: Op) -> list[Meta]:
    shape, dtype = _one(metas, op)
    a, b = op.args.get("dims", (0, 1))
    if max(a, b) >= len(shape):
        raise MappingError(f"{op.text()}: shape {list(shape)} has no dimension {max(a, b)}")
    out = list(shape)
    out[a], out[b] = out[b], out[a]
    return [(tuple(out), dtype)]


def _dim(shape: Sequence[int], op: Op) -> int:
    dim = op.args.get("dim", 0)
    if dim >= len(shape):
        raise MappingError(f"{op.text()}: shape {list(shape)} has no dimension {dim}")
    return int(dim)


def _split_shape(metas: Sequence[Meta], op: Op) -> list[Meta]:
    shape, dtype = _one(metas, op)
    dim, sizes = _dim(shape, op), list(op.args["sizes"])
    if sum(sizes) != shape[dim]:
        raise MappingError(f"{op.text()}: sizes add up to {sum(sizes)}, dimension {dim} is {shape[dim]}")
    return [((*shape[:dim], s, *shape[dim + 1 :]), dtype) for s in sizes]


def _concat_shape(metas: Sequence[Meta], op: Op) -> list[Meta]:
    sizes = list(op.args["sizes"])
    if len(metas) != len(sizes):
        raise MappingError(f"{op.text()} takes {len(sizes)} tensors, got {len(metas)}")
    dim = _dim(metas[0][0], op)
    for (shape, dtype), size in zip(metas, sizes, strict=True):
        if shape[dim] != size or shape[:dim] + shape[dim + 1 :] != metas[0][0][:dim] + metas[0][0][dim + 1 :]:
            raise MappingError(f"{op.text()}: a part of shape {list(shape)} does not fit (dimension {dim} {size})")
        if dtype is not metas[0][1]:
            raise MappingError(f"{op.text()}: parts of dtypes {metas[0][1]} and {dtype}")
    first = metas[0][0]
    return [((*first[:dim], sum(sizes), *first[dim + 1 :]), metas[0][1])]


def _unstack_shape(metas: Sequence[Meta], op: Op) -> list[Meta]:
    shape, dtype = _one(metas, op)
    dim, count = _dim(shape, op), op.args["count"]
    if shape[dim] != count:
        raise MappingError(f"{op.text()}: dimension {dim} holds {shape[dim]}, the config implies {count}")
    return [(shape[:dim] + shape[dim + 1 :], dtype)] * count


def _stack_shape(metas: Sequence[Meta], op: Op) -> list[Meta]:
    count = op.args["count"]
    if len(metas) != count:
        raise MappingError(f"{op.text()} takes {count} tensors, got {len(metas)}")
    if any(m != metas[0] for m in metas):
        raise MappingError(f"{op.text()}: the tensors differ in shape or dtype")
    shape, dtype = metas[0]
    dim = op.args.get("dim", 0)
    return [((*shape[:dim], count, *shape[dim:]), dtype)]


def _cast_shape(metas: Sequence[Meta], op: Op) -> list[Meta]:
    to = dtype_named(op.args["dtype"])
    return [(shape, to if dtype.is_floating_point else dtype) for shape, dtype in metas]


def _dequant_shape(metas: Sequence[Meta], op: Op) -> list[Meta]:
    if len(metas) != 2:
        raise MappingError(f"{op.text()} takes a weight and its scale_inv, got {len(metas)} tensors")
    (shape, _), (scale, _) = metas
    block = _block(op)
    want = tuple(-(-s // b) for s, b in zip(shape, block, strict=False))
    if len(shape) != 2 or scale != want:
        raise MappingError(f"{op.text()}: weight {list(shape)} needs scales {list(want)}, got {list(scale)}")
    return [(shape, dtype_named(op.args.get("dtype", "bfloat16")))]


def _block(op: Op) -> tuple[int, int]:
    block = op.args.get("block", 128)
    b = (block, block) if isinstance(block, int) else tuple(block)
    if len(b) != 2 or min(b) <= 0:
        raise MappingError(f"{op.text()}: block must be a positive size or two")
    return b[0], b[1]


def _permute(ts: list[torch.Tensor], op: Op) -> list[torch.Tensor]:
    h = op.args["heads"]
    return [w.reshape(h, w.shape[0] // h // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape) for w in ts]


def _unpermute(ts: list[torch.Tensor], op: Op) -> list[torch.Tensor]:
    h = op.args["heads"]
    return [w.reshape(h, 2, w.shape[0] // h // 2, w.shape[1]).transpose(1, 2).reshape(w.shape) for w in ts]


def _dequant(ts: list[torch.Tensor], op: Op) -> list[torch.Tensor]:
    import torch

    w, scale = ts
    b0, b1 = _block(op)
    full = scale.to(torch.float32).repeat_interleave(b0, 0)[: w.shape[0]].repeat_interleave(b1, 1)[:, : w.shape[1]]
    return [(w.to(torch.float32) * full).to(dtype_named(op.args.get("dtype", "bfloat16")).torch)]


def _cast(ts: list[torch.Tensor], op: Op) -> list[torch.Tensor]:
    to = dtype_named(op.args["dtype"]).torch
    return [t.to(to) if t.is_floating_point() else t for t in ts]


def _torch() -> Any:
    import torch

    return torch


Apply = Callable[[list["torch.Tensor"], Op], list["torch.Tensor"]]
OPS: dict[str, tuple[Callable[[Sequence[Meta], Op], list[Meta]], Apply]] = {
    "permute": (_each(_rows_by_heads), _permute),
    "unpermute": (_each(_rows_by_heads), _unpermute),
    "transpose": (_each(_transpose_shape), lambda ts, op: [t.transpose(*op.args.get("dims", (0, 1))) for t in ts]),
    "split": (_split_shape, lambda ts, op: list(ts[0].split(list(op.args["sizes"]), op.args.get("dim", 0)))),
    "concat": (_concat_shape, lambda ts, op: [_torch().cat(ts, op.args.get("dim", 0))]),
    "unstack": (_unstack_shape, lambda ts, op: list(ts[0].unbind(op.args.get("dim", 0)))),
    "stack": (_stack_shape, lambda ts, op: [_torch().stack(ts, op.args.get("dim", 0))]),
    "cast": (_cast_shape, _cast),
    "dequant_fp8": (_dequant_shape, _dequant),
}
"""Each operation's shape function and tensor function."""

_INVERSE = {
    "permute": "unpermute",
    "unpermute": "permute",
    "transpose": "transpose",
    "split": "concat",
    "concat": "split",
    "unstack": "stack",
    "stack": "unstack",
}
ONE_WAY = frozenset(OPS) - frozenset(_INVERSE)
"""Operations that lose what their inverse would need (a cast's rounding, fp8 scales)."""


def shape_ops(metas: Sequence[Meta], ops: Sequence[Op]) -> list[Meta]:
    """The shapes and dtypes ``ops`` make of tensors of ``metas``, refusing what cannot apply."""
    out = list(metas)
    for op in ops:
        out = OPS[op.kind][0](out, op)
    return out


def apply_ops(tensors: list[torch.Tensor], ops: Sequence[Op]) -> list[torch.Tensor]:
    for op in ops:
        tensors = OPS[op.kind][1](tensors, op)
    return tensors


def _permuted_rows(rows: int, heads: int, inverse: bool) -> list[int]:
    """The source row of each output row of ``permute`` (``unpermute`` when ``inverse``): within a
    head of ``n`` rows, output ``k * n/2 + j`` is source ``2j + k`` (its inverse the other way)."""
    n = rows // heads
    half = n // 2
    within = [2 * j + k for k in (0, 1) for j in range(half)]
    if inverse:
        back = [0] * n
        for out, src in enumerate(within):
            back[src] = out
        within = back
    return [h * n + r for h in range(heads) for r in within]


def row_order(ops: Sequence[Op], rows: int) -> list[int] | None:
    """When ``ops`` on one tensor of ``rows`` rows only reorder its rows (``permute``/``unpermute``
    chains): the source row of each output row, so its bytes can be gathered without torch (whose
    import alone costs more than moving a model's q/k weights). Else None."""
    order = list(range(rows))
    for op in ops:
        if op.kind not in ("permute", "unpermute"):
            return None
        step = _permuted_rows(rows, op.args["heads"], op.kind == "unpermute")
        order = [order[r] for r in step]
    return order


def inverse_ops(ops: Sequence[Op]) -> list[Op] | None:
    """The chain that undoes ``ops`` (None when one of them is one way)."""
    if any(op.kind in ONE_WAY for op in ops):
        return None
    return [Op(_INVERSE[op.kind], op.args) for op in reversed(ops)]
