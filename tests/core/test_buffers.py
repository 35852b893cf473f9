"""Recycled block buffers: reads reuse memory only when the caller gives it back, and a verify
that reads block pairs ahead on reader threads into recycled buffers gets every figure right."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dcpstudio.core import diff, open_checkpoint, torch_save_to_dcp
from dcpstudio.core.io.buffers import BufferPool, new_tensor


def test_pool_reuses_only_what_it_lent() -> None:
    pool = BufferPool(keep=2)
    assert new_tensor([1 << 20], torch.uint8).untyped_storage().data_ptr() not in pool._lent  # no pool active
    with pool.active():
        a = new_tensor([512, 1024], torch.float32)
        small = new_tensor([10], torch.float32)  # small tensors come from malloc
    stranger = torch.empty(512, 1024)
    pool.give(stranger, small)
    with pool.active():
        b = new_tensor([512, 1024], torch.float32)
    assert b.data_ptr() != stranger.data_ptr() and b.data_ptr() != a.data_ptr()  # a is not given back yet
    ptr = a.data_ptr()
    pool.give(a.reshape(-1))  # a view of the lent storage gives the storage back
    del a
    with pool.active():
        c = new_tensor([1024, 512], torch.float32)  # same bytes, another shape
        d = new_tensor([1024, 256], torch.float32)  # other bytes: fresh
    assert c.data_ptr() == ptr and d.data_ptr() != ptr
    pool.give(c)
    pool.give(c)  # given twice: taken once
    assert len(pool._free) == 1


@pytest.mark.parametrize("dst", ["pt", "dcp"])
def test_verify_reading_ahead_into_recycled_buffers(tmp_path: Path, dst: str) -> None:
    """4 MiB tensors in 1 MiB blocks take the threaded, recycled path; differences placed in
    different blocks of different tensors are each counted exactly where they are."""
    g = torch.Generator().manual_seed(11)
    a = {f"t{i}": torch.randn(1024, 1024, generator=g) for i in range(4)}
    b = {k: v.clone() for k, v in a.items()}
    b["t0"][900, 5] += 1  # the last block
    b["t2"][10:20] *= 2  # the first block
    b["t3"][300, :] = math.nan
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    other = tmp_path / "b.pt"
    if dst == "dcp":
        torch_save_to_dcp(tmp_path / "b.pt", tmp_path / "b_dcp")
        other = tmp_path / "b_dcp"
    with open_checkpoint(tmp_path / "a.pt") as x, open_checkpoint(other) as y:
        report = diff(x, y, budget=1 << 20)
    got = {v.fqn: v for v in report.values}
    assert set(got) == {"t0", "t2", "t3"}
    assert (got["t0"].mismatched, got["t0"].first_index) == (1, (900, 5))
    assert (got["t2"].mismatched, got["t2"].first_index) == (10 * 1024 - int((a["t2"][10:20] == 0).sum()), (10, 0))
    assert (got["t3"].mismatched, got["t3"].nonfinite, got["t3"].first_index) == (1024, 1024, (300, 0))
    ref = float((a["t2"].double() - b["t2"].double()).norm() / a["t2"].double().norm())
    assert got["t2"].rel_l2 == pytest.approx(ref, rel=1e-12)
    assert got["t2"].max_abs == pytest.approx(float(a["t2"][10:20].abs().max()), rel=1e-12)
