"""Element types of checkpoint tensors, known without importing torch.

Checkpoint *structure* -- names, dtypes, shapes, where bytes lie -- is read with no torch at all
(importing it costs seconds); torch is loaded only where tensor values are made. A :class:`DType`
names one of torch's dtypes and carries what the formats need: element size, kind, the
safetensors code and torch.save's legacy storage class. ``.torch`` gives the torch dtype (and
imports torch). A DType compares equal to its torch dtype, so ``entry.dtype == torch.bfloat16``
holds.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["DTYPES", "DType", "dtype_of"]


class DType:
    """One tensor element type. ``kind``: ``f`` float, ``c`` complex, ``i`` signed int,
    ``u`` unsigned int, ``b`` bool, ``q`` quantized (no values DCP Studio can read). ``pack``:
    elements per stored element -- 2 for ``float4_e2m1fn_x2``, whose torch element is a byte of
    two 4-bit floats, as safetensors' ``F4`` counts them one by one (and torch has no arithmetic
    on it: :func:`~._tensor_io.numeric` decodes it)."""

    __slots__ = ("itemsize", "kind", "name", "pack", "safetensors", "storage")

    def __init__(
        self, name: str, itemsize: int, kind: str, safetensors: str | None, storage: str | None, pack: int = 1
    ) -> None:
        self.name = name
        self.pack = pack
        self.itemsize = itemsize
        self.kind = kind
        self.safetensors = safetensors
        self.storage = storage  # torch.save's legacy storage class (FloatStorage), None for newer dtypes

    @property
    def is_floating_point(self) -> bool:
        return self.kind == "f"

    @property
    def is_complex(self) -> bool:
        return self.kind == "c"

    @property
    def torch(self) -> Any:
        """The ``torch.dtype`` (imports torch)."""
        import torch

        return getattr(torch, self.name)

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        return (dtype_of, (self.name,))  # checkpoint pickles write ``torch.<name>`` (see _pickle)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return other is self
        torch = sys.modules.get("torch")  # being imported on another thread: may not have dtype yet
        if torch is not None and isinstance(other, getattr(torch, "dtype", ())):
            return str(other) == f"torch.{self.name}"
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)


_TABLE: list[tuple[Any, ...]] = [
    # name, itemsize, kind, safetensors, legacy storage class[, pack]
    ("float64", 8, "f", "F64", "DoubleStorage"),
    ("float32", 4, "f", "F32", "FloatStorage"),
    ("float16", 2, "f", "F16", "HalfStorage"),
    ("bfloat16", 2, "f", "BF16", "BFloat16Storage"),
    ("float8_e4m3fn", 1, "f", "F8_E4M3", None),
    ("float8_e5m2", 1, "f", "F8_E5M2", None),
    ("float8_e4m3fnuz", 1, "f", "F8_E4M3FNUZ", None),
    ("float8_e5m2fnuz", 1, "f", "F8_E5M2FNUZ", None),
    ("float8_e8m0fnu", 1, "f", "F8_E8M0", None),
    ("float4_e2m1fn_x2", 1, "f", "F4", None, 2),
    ("complex128", 16, "c", None, "ComplexDoubleStorage"),
    ("complex64", 8, "c", "C64", "ComplexFloatStorage"),
    ("complex32", 4, "c", None, None),
    ("int64", 8, "i", "I64", "LongStorage"),
    ("int32", 4, "i", "I32", "IntStorage"),
    ("int16", 2, "i", "I16", "ShortStorage"),
    ("int8", 1, "i", "I8", "CharStorage"),
    ("uint64", 8, "u", "U64", None),
    ("uint32", 4, "u", "U32", None),
    ("uint16", 2, "u", "U16", None),
    ("uint8", 1, "u", "U8", "ByteStorage"),
    ("bool", 1, "b", "BOOL", "BoolStorage"),
    ("qint8", 1, "q", None, "QInt8Storage"),
    ("qint32", 4, "q", None, "QInt32Storage"),
    ("quint8", 1, "q", None, "QUInt8Storage"),
    ("quint4x2", 1, "q", None, "QUInt4x2Storage"),
    ("quint2x4", 1, "q", None, "QUInt2x4Storage"),
]
DTYPES: dict[str, DType] = {row[0]: DType(*row) for row in _TABLE}
_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "chalf": "complex32",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}
BY_NAME: dict[str, DType] = {**DTYPES, **{alias: DTYPES[name] for alias, name in _ALIASES.items()}}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in DTYPES.values() if d.safetensors}
# what safetensors names and torch has no dtype for (safetensors' own torch reader refuses them too)
NO_TORCH_DTYPE = {"F6_E2M3": "6-bit float (e2m3)", "F6_E3M2": "6-bit float (e3m2)"}
BY_STORAGE: dict[str, DType] = {d.storage: d for d in DTYPES.values() if d.storage}


def dtype_of(value: Any) -> DType:
    """The :class:`DType` for a DType, a ``torch.dtype`` or a name (``"bfloat16"``, ``"torch.bfloat16"``)."""
    if isinstance(value, DType):
        return value
    name = str(value).removeprefix("torch.")
    found = BY_NAME.get(name)
    if found is None:
        raise ValueError(f"unsupported tensor element type {value!r}")
    return found
