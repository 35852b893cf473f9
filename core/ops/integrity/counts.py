"""What ``check --values`` counts in a tensor -- elements, NaNs, infinities, zeros -- at disk speed
and without torch where its bytes lie in place (:func:`~...checkpoints.canonical.canonical_source`).

The counts are bit tests on the stored elements with numpy, not arithmetic: floats are read as
unsigned integers with the sign bit cleared (one pass into a recycled buffer), whose maximum below
the all-ones exponent means no NaN or Inf (only a block with one is counted element by element:
the all-ones exponent is Inf, above it NaN) and whose zeros are the zeros of either sign --
``count_nonzero`` on integers is ~10x faster than on floats (2 GiB/s in all against 1, measured). They equal what
:func:`~..explore.stats.tensor_stats` counts through torch, the path taken for everything else
(complex, the ``fnuz`` and ``e8m0`` float8 kinds, compressed chunks).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ...checkpoints.base import Checkpoint
from ...checkpoints.canonical import RawBuffers, canonical_source
from ...io.blocks import BLOCK_BUDGET
from ...progress import CancelToken

__all__ = ["Counts", "release_buffers", "value_counts"]

# bits as unsigned integers: (numpy kind, mask clearing the sign, exponent all ones = Inf, NaN above;
# None: no infinity, the all-ones pattern under the mask is NaN)
_BITS: dict[str, tuple[str, int, int | None]] = {
    "float32": ("<u4", 0x7FFF_FFFF, 0x7F80_0000),
    "float64": ("<u8", 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "float16": ("<u2", 0x7FFF, 0x7C00),
    "bfloat16": ("<u2", 0x7FFF, 0x7F80),
    "float8_e5m2": ("u1", 0x7F, 0x7C),
    "float8_e4m3fn": ("u1", 0x7F, None),
}
_PLAIN = {"bool": "u1", "int8": "i1", "uint8": "u1", "int16": "<i2", "int32": "<i4", "int64": "<i8",
          "uint16": "<u2", "uint32": "<u4", "uint64": "<u8"}  # fmt: skip
_BUFFERS = RawBuffers(keep=4)


@dataclass
class Counts:
    count: int = 0
    nan: int = 0
    inf: int = 0
    zeros: int = 0

    def add(self, dtype: str, block: Any) -> None:
        import numpy as np

        if dtype in _BITS:
            kind, mask, inf = _BITS[dtype]
            u = block.view(kind)
            n = u.size
            a = _BUFFERS.take(u.nbytes).view(kind)
            try:
                np.bitwise_and(u, mask, out=a)
                top = inf if inf is not None else mask
                if n and int(a.max()) >= top:
                    if inf is None:
                        self.nan += int(np.count_nonzero(a == mask))
                    else:
                        self.inf += int(np.count_nonzero(a == inf))
                        self.nan += int(np.count_nonzero(a > inf))
                self.zeros += n - int(np.count_nonzero(a))
            finally:
                _BUFFERS.give(a.view(np.uint8))
            self.count += n
            return
        else:
            x = block.view(_PLAIN[dtype])
            n = x.size
        self.count += n
        self.zeros += n - int(np.count_nonzero(x))


def value_counts(
    ckpt: Checkpoint, fqn: str, *, budget: int = BLOCK_BUDGET, cancel: CancelToken | None = None
) -> Counts | None:
    """The counts of tensor ``fqn`` read in place without torch, or None when its dtype or its
    storage needs torch (the caller then asks :func:`~..explore.stats.tensor_stats`)."""
    entry = ckpt.tensor_entry(fqn)
    name = entry.dtype.name if entry.dtype is not None else ""
    if sys.byteorder != "little" or name not in (*_BITS, *_PLAIN):
        return None
    source = canonical_source(ckpt, fqn)
    if source is None:
        return None
    out = Counts()
    for block in source.blocks(budget, _BUFFERS):
        try:
            if cancel is not None:
                cancel.check()
            out.add(name, block)
        finally:
            _BUFFERS.give(block)
    return out


def release_buffers() -> None:
    """Let the block buffers go once a run is over."""
    _BUFFERS.clear()
