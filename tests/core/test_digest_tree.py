"""The tree digest and the moments of :mod:`dcpstudio.core.formats.digest`: the same value however
the bytes arrive (split anywhere, hashed on threads or not, read back from a written file), equal to
the definition, and moments equal to a float64 reference."""

from __future__ import annotations

import hashlib
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from dcpstudio.core.formats.digest import PIECE, Moments, TreeHasher, canonical_header
from dcpstudio.core.formats.manifest import TensorTap


def _definition(header: bytes, data: bytes) -> str:
    pieces = b"".join(hashlib.sha256(data[i : i + PIECE]).digest() for i in range(0, len(data), PIECE))
    return "sha256-tree:" + hashlib.sha256(header + pieces).hexdigest()


@pytest.mark.parametrize("size", [0, 7, PIECE, 2 * PIECE + 12345])
def test_tree_digest_is_the_definition_however_fed(size: int) -> None:
    data = random.Random(size).randbytes(size)
    header = canonical_header("uint8", (size,))
    want = _definition(header, data)
    rnd = random.Random(1)
    with ThreadPoolExecutor(2) as pool:
        for use_pool, total in ((None, None), (pool, None), (pool, size)):
            h = TreeHasher(header, use_pool, total)
            at = 0
            while at < size:
                n = rnd.choice([1, 4096, PIECE - 3, PIECE, 3 * PIECE])
                h.update(memoryview(data)[at : at + n])
                at += n
            assert h.digest() == want


def _reference(x: np.ndarray) -> dict[str, float | int]:
    f = x.astype(np.float64)
    finite = f[np.isfinite(f)]
    return {"min": finite.min(), "max": finite.max(), "mean": finite.mean(), "std": finite.std(),
            "nan": int(np.isnan(f).sum()), "inf": int(np.isinf(f).sum())}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int32"])
def test_moments_match_float64_however_split(dtype: str) -> None:
    rng = np.random.default_rng(0)
    base = (rng.standard_normal(300_000) * 0.02 + 3.0).astype(np.float32)  # |mean| >> std
    if dtype == "bfloat16":
        stored = (base.view(np.uint32) >> 16).astype(np.uint16)
        stored[[5, 70_000]] = [0x7FC0, 0x7F80]  # NaN, +Inf
        values = (stored.astype(np.uint32) << 16).view(np.float32)
    elif dtype == "int32":
        stored = values = rng.integers(-1000, 1000, 300_000).astype(np.int32)
    else:
        stored = base.astype(dtype)
        stored[[5, 70_000]] = [np.nan, -np.inf]
        values = stored
    raw = stored.tobytes()
    want = _reference(values)
    item = stored.itemsize
    whole = Moments.of(dtype, raw)
    streamed, merged = Moments(), Moments()
    for at in range(0, len(raw), 77_777 * item):
        streamed.add(dtype, raw[at : at + 77_777 * item])
    streamed.finish(dtype)
    for at in reversed(range(0, len(raw), 1 << 20)):  # runs on the grid, merged in any order
        merged.merge(Moments.of(dtype, raw[at : at + (1 << 20)]))
    assert whole.record() == streamed.record() == merged.record()  # exactly: the manifest's determinism
    for got in (whole.record(),):
        assert got["nan"] == want["nan"] and got["inf"] == want["inf"]
        assert got["min"] == want["min"] and got["max"] == want["max"]
        assert got["mean"] == pytest.approx(want["mean"], rel=1e-7)
        assert got["std"] == pytest.approx(want["std"], rel=1e-5)


def test_a_dcp_conversion_records_what_hash_computes_for_a_many_piece_tensor(tmp_path: Path) -> None:
    """The read-back (pieces on two threads, from the file) and hash (blocks in row-major order,
    pieces gathered across blocks) agree with the source's digest, for a tensor of several pieces
    whose rows do not fall on piece boundaries."""
    import torch

    from dcpstudio.core import open_checkpoint
    from dcpstudio.core.ops.convert.convert import convert
    from dcpstudio.core.ops.integrity import digests
    from dcpstudio.core.ops.integrity.manifests import read_manifest

    w = torch.randn(3 * 1000 + 1, 3001)  # ~36 MiB: 3 pieces, rows of 12,004 bytes
    torch.save({"w": w, "v": w[::2, 1:].t()}, tmp_path / "m.pt")  # a strided view, stored apart
    convert(tmp_path / "m.pt", tmp_path / "d")
    manifest = read_manifest(tmp_path / "d")
    assert manifest is not None
    for src in (tmp_path / "m.pt", tmp_path / "d"):
        with open_checkpoint(src) as ckpt:
            got = {d.fqn: d.digest for d in digests(ckpt, budget=5 << 20)}
        assert got == {n: r["digest"] for n, r in manifest.tensors.items()}
    data = w.contiguous().numpy().tobytes()
    assert manifest.tensors["w"]["digest"] == _definition(canonical_header("float32", tuple(w.shape)), data)
    tap = TensorTap("float32", tuple(w.shape))
    tap.update(data)
    assert tap.record() == manifest.tensors["w"]
    from dcpstudio.core.ops.integrity.manifests import write_manifest

    with open_checkpoint(tmp_path / "m.pt") as ckpt:  # `hash --manifest`: pieces on threads, moments beside
        side = write_manifest(ckpt, [tmp_path / "m.pt"], budget=5 << 20)
    again = read_manifest(tmp_path / "m.pt")
    assert side.is_file() and again is not None and again.tensors == manifest.tensors
