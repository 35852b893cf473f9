"""CRC-32 of a whole from the CRC-32s of its pieces, as zlib's ``crc32_combine`` computes it.

A distributed conversion's ranks each hash the byte range of a record they wrote; the ZIP header
of a torch.save or DCP record needs the CRC of the whole, which one rank combines from the pieces
without reading them again. Python's ``zlib`` module does not expose ``crc32_combine``, so this is
zlib's GF(2) matrix method in pure Python: appending ``n`` zero bytes to a message is a linear map
on its CRC register, applied by squaring the one-zero-bit operator log2(n) times.
"""

from __future__ import annotations

__all__ = ["crc32_combine"]

_POLY = 0xEDB88320  # CRC-32 (reflected), as zlib


def _times(matrix: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= matrix[i]
        vec >>= 1
        i += 1
    return out


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)``."""
    if len2 <= 0:
        return crc1
    odd = [_POLY] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _square(odd)  # two zero bits
    odd = _square(even)  # four zero bits
    while True:  # apply len2 zero bytes to crc1, one bit of len2 at a time
        even = _square(odd)
        if len2 & 1:
            crc1 = _times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _square(even)
        if len2 & 1:
            crc1 = _times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return (crc1 ^ crc2) & 0xFFFFFFFF
