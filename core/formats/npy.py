"""NumPy's ``.npy`` file format, written without NumPy: a header, then the array's bytes.

The header (format versions 1.0 and 2.0) is a Python dict literal -- ``descr`` (the element type),
``fortran_order`` and ``shape`` -- padded so the data starts on a 64-byte boundary, as
``numpy.lib.format`` writes it; the row-major bytes follow, so an array can be streamed in pieces.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence

from ..dtypes import DType

__all__ = ["npy_descr", "npy_header"]

_MAGIC = b"\x93NUMPY"
_ALIGN = 64
_CODES = {
    "bool": "b1",
    "int8": "i1",
    "uint8": "u1",
    "int16": "i2",
    "uint16": "u2",
    "int32": "i4",
    "uint32": "u4",
    "int64": "i8",
    "uint64": "u8",
    "float16": "f2",
    "float32": "f4",
    "float64": "f8",
    "complex64": "c8",
    "complex128": "c16",
}


def npy_descr(dtype: DType) -> str | None:
    """NumPy's type string for ``dtype`` in this machine's byte order (``'<f4'``), or None when
    NumPy has no such type (bfloat16, the float8 types, complex32, quantized types)."""
    code = _CODES.get(dtype.name)
    if code is None:
        return None
    order = "|" if dtype.itemsize == 1 else ("<" if sys.byteorder == "little" else ">")
    return order + code


def npy_header(descr: str, shape: Sequence[int]) -> bytes:
    """The magic, version and header of a C-ordered ``.npy`` array; its data follows directly."""
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    for version, length in ((1, "<H"), (2, "<I")):
        prefix = len(_MAGIC) + 2 + struct.calcsize(length)
        pad = -(prefix + len(text) + 1) % _ALIGN
        body = (text + " " * pad + "\n").encode("latin1")
        if len(body) < 1 << (8 * struct.calcsize(length)):
            return _MAGIC + bytes((version, 0)) + struct.pack(length, len(body)) + body
    raise ValueError(f"an array of {len(shape)} dimensions has too long a .npy header")
