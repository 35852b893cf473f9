"""The torch-free float32 -> bfloat16 cast against torch's own ``Tensor.to``, bit for bit; and
the direct writer's ragged heads and tails. ``DCPSTUDIO_EXHAUSTIVE_CAST=1``: all 2**32 patterns."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dcpstudio.core.dtypes import DTYPES
from dcpstudio.core.io.direct import ALIGN, BlockPool, DirectWriter
from dcpstudio.core.ops.convert.casting import bf16_from_f32, cast_into, cast_threads


def _torch(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _ours(bits: np.ndarray) -> np.ndarray | None:
    out = np.empty(bits.size, dtype=np.uint16)
    return out if bf16_from_f32(memoryview(bits.view(np.float32)).cast("B"), memoryview(out).cast("B")) else None


def _patterns() -> np.ndarray:
    """Every sign and exponent (0: zeros and subnormals, 255: infinities) with the mantissas at the
    rounding edges -- the kept part's last bit 0 and 1, the dropped part below, at, above half --
    and 200,000 random patterns."""
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    highs = np.array([0, 1, 2, 3, 0x3F, 0x40, 0x7E, 0x7F], dtype=np.uint32)
    mant = (highs[:, None] << 16 | lows[None, :]).ravel()
    top = np.arange(512, dtype=np.uint32) << 23  # sign and exponent
    edges = (top[:, None] | mant[None, :]).ravel()
    rng = np.random.default_rng(0)
    return np.concatenate([edges, rng.integers(0, 1 << 32, 200_000, dtype=np.uint32)])


def test_bf16_matches_torch_bit_for_bit() -> None:
    bits = _patterns()
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    finite = bits[~nan]
    assert np.array_equal(_ours(finite), _torch(finite))
    assert _ours(bits) is None  # a NaN anywhere: torch casts the run
    out = np.empty(bits.size, dtype=np.uint16)  # and through cast_into, whichever path runs, the same bytes
    cast_into(memoryview(bits).cast("B"), DTYPES["float32"], DTYPES["bfloat16"], memoryview(out).cast("B"))
    assert np.array_equal(out, _torch(bits))


@pytest.mark.skipif(not os.environ.get("DCPSTUDIO_EXHAUSTIVE_CAST"), reason="set DCPSTUDIO_EXHAUSTIVE_CAST=1 (~1 min)")
def test_bf16_matches_torch_on_every_pattern() -> None:
    step = 1 << 26
    for start in range(0, 1 << 32, step):
        bits = np.arange(start, start + step, dtype=np.uint64).astype(np.uint32)
        bits = bits[(bits & 0x7FFFFFFF) <= 0x7F800000]
        assert np.array_equal(_ours(bits), _torch(bits)), hex(start)


def test_a_long_cast_on_threads_is_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run cut into parts cast at once on threads: torch's bytes, ragged last part included; a NaN
    in the last part only still hands the whole run to torch."""
    bits = np.concatenate([_patterns(), np.random.default_rng(1).integers(0, 1 << 32, 600_000, dtype=np.uint32)])
    bits = bits[(bits & 0x7FFFFFFF) <= 0x7F800000][: 3 * (1 << 18) + 3]  # 3 MiB and 12 bytes, no NaN
    out = np.empty(bits.size, dtype=np.uint16)
    src = memoryview(bits.view(np.float32)).cast("B")
    assert bf16_from_f32(src, memoryview(out).cast("B"), threads=3)
    assert np.array_equal(out, _torch(bits))
    bits[-1] = 0x7FC00001
    assert not bf16_from_f32(memoryview(bits.view(np.float32)).cast("B"), memoryview(out).cast("B"), threads=3)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # ranks sharing the cores, as torchrun sets it
    assert cast_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    assert cast_threads() == 8


def test_direct_writer_places_ragged_blocks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "out.bin"
    size = 5 * ALIGN + 123
    expected = bytearray(os.urandom(size))
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_WRONLY)
    try:
        with DirectWriter(path, fd, capacity=3 * ALIGN) as w:
            for a, b in ((0, 10), (10, ALIGN + 7), (ALIGN + 7, 4 * ALIGN + 1), (4 * ALIGN + 1, size)):
                block = w.block(a, b - a)
                block.view[:] = expected[a:b]
                w.write(block)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == expected


def test_writers_of_many_files_share_one_pool(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The blocks of 8 files' writers, interleaved, come from one pool: the files get their bytes
    and the pool never holds more buffers than are lent at once plus the ones it keeps."""
    size = 3 * ALIGN + 5
    expected = [os.urandom(size) for _ in range(8)]
    fds = []
    for i in range(8):
        (tmp_path / f"{i}.bin").write_bytes(b"\0" * size)
        fds.append(os.open(tmp_path / f"{i}.bin", os.O_WRONLY))
    try:
        with BlockPool(2 * ALIGN, keep=2) as pool:
            writers = [DirectWriter(tmp_path / f"{i}.bin", fd, pool=pool) for i, fd in enumerate(fds)]
            for a, b in ((0, ALIGN + 1), (ALIGN + 1, 3 * ALIGN), (3 * ALIGN, size)):
                lent = [w.block(a, b - a) for w in writers[:2]]  # two lent at once
                for w, block, data in zip(writers[:2], lent, expected[:2], strict=True):
                    block.view[:] = data[a:b]
                    w.write(block)
                for w, data in zip(writers[2:], expected[2:], strict=True):
                    block = w.block(a, b - a)
                    block.view[:] = data[a:b]
                    w.write(block)
                assert pool.allocated <= 2
            for w in writers:
                w.close()
            assert pool.allocated == 2  # the writers leave a shared pool open
        assert pool.allocated == 0
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    assert [(tmp_path / f"{i}.bin").read_bytes() for i in range(8)] == expected


def test_cast_into_dcp_files_is_torchs_cast(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A DCP target's cast is computed block by block into each data file's records (as for
    torch.save and safetensors): ``dcp.load`` reads torch's own cast, over several files, with a
    manifest ``check`` verifies, and a value beside the tensors."""
    import torch.distributed.checkpoint as dcp

    from dcpstudio.core import convert
    from dcpstudio.core.ops.integrity import check_path

    g = torch.Generator().manual_seed(5)
    sd = {"a": torch.randn(700, 333, generator=g), "b": torch.randn(5000, generator=g), "step": 7}
    torch.save(sd, tmp_path / "src.pt")
    convert(tmp_path / "src.pt", tmp_path / "out", to="dcp", dtype="bf16", files=2)
    got = {"a": torch.empty(700, 333, dtype=torch.bfloat16), "b": torch.empty(5000, dtype=torch.bfloat16), "step": 0}
    dcp.load(got, checkpoint_id=str(tmp_path / "out"))
    for k in ("a", "b"):
        assert torch.equal(got[k].view(torch.int16), sd[k].to(torch.bfloat16).view(torch.int16))
    assert got["step"] == 7
    assert sorted(p.name for p in (tmp_path / "out").glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    assert check_path(tmp_path / "out").whole
