"""Streaming stats agree with a float64 reference; diff finds each kind of difference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dcpstudio.core import diff, open_checkpoint, tensor_stats, torch_save_to_dcp
from dcpstudio.core.io.blocks import blocks


def _reference(t: torch.Tensor) -> dict[str, float]:
    x = (t.abs() if t.is_complex() else t).to(torch.float64).reshape(-1)
    good = x[torch.isfinite(x)]
    return {
        "count": x.numel(),
        "nan": int(torch.isnan(x).sum()),
        "posinf": int(torch.isposinf(x).sum()),
        "neginf": int(torch.isneginf(x).sum()),
        "zeros": int((x == 0).sum()),
        "finite": good.numel(),
        "min": float(good.min()),
        "max": float(good.max()),
        "mean": float(good.mean()),
        "std": float(good.std(correction=0)),
    }


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    f = torch.randn(300, 17, generator=g) * 5 + 2
    f[3, 4], f[10, 0], f[20, 1], f[0, 0] = math.nan, math.inf, -math.inf, 0.0
    out = {
        "f32": f,
        "bf16": f.to(torch.bfloat16),
        "f16": f.to(torch.float16),
        "f64": f.double(),
        "f8": torch.randn(64, 33, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.randint(-1000, 1000, (123, 7), generator=g),
        "u8": torch.randint(0, 255, (999,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(50, 50, generator=g) > 0.3,
        "c64": torch.randn(40, dtype=torch.complex64, generator=g),
        "scalar": torch.tensor(2.5),
    }
    return out


@pytest.mark.parametrize("budget", [64, 4096, 1 << 20])
def test_stats_match_float64_reference(tmp_path: Path, budget: int) -> None:
    tensors = _tensors()
    torch.save(tensors, tmp_path / "t.pt")
    with open_checkpoint(tmp_path / "t.pt") as ckpt:
        for name, t in tensors.items():
            s = tensor_stats(ckpt, name, bins=16, budget=budget)
            ref = _reference(t)
            for key in ("count", "nan", "posinf", "neginf", "zeros", "finite"):
                assert getattr(s, key) == ref[key], (name, key)
            for key in ("min", "max", "mean", "std"):
                assert getattr(s, key) == pytest.approx(ref[key], rel=1e-9, abs=1e-12), (name, key)
            assert sum(s.hist_counts) == ref["finite"] and len(s.hist_edges) == 17
            assert s.hist_edges[0] == ref["min"]
            if ref["max"] > ref["min"]:  # a constant tensor gets one unit-wide range
                assert s.hist_edges[-1] == pytest.approx(ref["max"])


def test_stats_reads_in_bounded_blocks(tmp_path: Path) -> None:
    big = torch.arange(100_000, dtype=torch.float32).reshape(1000, 100)
    torch.save({"big": big}, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "b.pt") as ckpt:
        sizes = []
        real = ckpt.read_tensor
        ckpt.read_tensor = lambda fqn, region=None: sizes.append(region) or real(fqn, region)  # type: ignore[method-assign]
        s = tensor_stats(ckpt, "big", bins=0, budget=40_000)
    assert len(sizes) == 10 and s.mean == pytest.approx(49_999.5)


def _hist_reference(t: torch.Tensor, bins: int) -> list[int]:
    x = t.reshape(-1)
    good = x[torch.isfinite(x)]
    lo, hi = float(good.min()), float(good.max())
    return [int(c) for c in torch.histc(good, bins=bins, min=lo, max=hi).tolist()]


@pytest.mark.parametrize("budget", [1 << 20, 64 << 20])
@pytest.mark.parametrize("bad", ["none", "few", "many"])
def test_stats_on_large_offset_values_and_nonfinite_runs(tmp_path: Path, budget: int, bad: str) -> None:
    """Values far from zero (1e4 + noise: one-pass sums would cancel), more elements than one float64
    sub-block, blocks with no, a few and many non-finite values: moments within 1e-9 of float64,
    counts exact, and the block-wise histogram equal to one histc over the whole tensor."""
    g = torch.Generator().manual_seed(7)
    t = torch.randn(1_200_000, generator=g).mul_(1e-2).add_(1e4)
    t[::1000] = 0.0
    if bad == "few":
        t[[5, 6, 1_048_575, 1_048_576, 1_199_999]] = torch.tensor([math.nan, math.inf, -math.inf, math.nan, math.inf])
    elif bad == "many":
        t[1::7] = math.nan
        t[3::11] = -math.inf
    tensors = {"f32": t, "f64": t.double()}
    torch.save(tensors, tmp_path / "t.pt")
    with open_checkpoint(tmp_path / "t.pt") as ckpt:
        for name, x in tensors.items():
            s = tensor_stats(ckpt, name, bins=32, budget=budget)
            ref = _reference(x)
            for key in ("count", "nan", "posinf", "neginf", "zeros", "finite"):
                assert getattr(s, key) == ref[key], (name, key)
            for key in ("min", "max", "mean", "std"):
                assert getattr(s, key) == pytest.approx(ref[key], rel=1e-9, abs=1e-12), (name, key)
            assert s.hist_counts == _hist_reference(x, 32), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_histogram_of_the_widest_range(tmp_path: Path, dtype: torch.dtype) -> None:
    """Values near both ends of the type: ``max - min`` overflows, the histogram still counts all."""
    top = torch.finfo(dtype).max
    t = torch.tensor([-top, -top * 0.3, top * 0.1, top * 0.2, top * 0.9, top], dtype=dtype)
    torch.save({"t": t}, tmp_path / "t.pt")
    with open_checkpoint(tmp_path / "t.pt") as ckpt:
        s = tensor_stats(ckpt, "t", bins=4)
    assert s.hist_counts == [1, 1, 2, 2] and all(math.isfinite(e) for e in s.hist_edges)
    assert s.hist_edges[0] == -top and s.hist_edges[-1] == pytest.approx(top)


def test_stats_of_a_tensor_without_finite_values(tmp_path: Path) -> None:
    t = torch.full((3000,), math.nan)
    t[::2] = math.inf
    torch.save({"t": t}, tmp_path / "t.pt")
    with open_checkpoint(tmp_path / "t.pt") as ckpt:
        s = tensor_stats(ckpt, "t", bins=8, budget=4096)
    assert (s.count, s.finite, s.nan, s.posinf, s.neginf) == (3000, 0, 1500, 1500, 0)
    assert math.isnan(s.mean) and math.isnan(s.std) and s.hist_counts == []


def test_blocks_tile_shapes_within_budget() -> None:
    for shape in [(5,), (3, 4), (2, 3, 7), (1, 1, 1), (6, 1000)]:
        seen = 0
        for _offsets, sizes in blocks(shape, 4, 40):
            n = math.prod(sizes)
            assert n * 4 <= 40 or n == 1
            seen += n
        assert seen == math.prod(shape)


def test_diff_finds_each_kind_of_difference(tmp_path: Path) -> None:
    base = {
        "same": torch.arange(10.0),
        "values": torch.ones(1000),
        "dtype": torch.ones(3),
        "shape": torch.ones(4),
        "kind": torch.ones(1),
        "obj": {"lr": 0.1},
        "nan": torch.tensor([math.nan, 1.0]),
        "only_a": torch.ones(1),
    }
    other = dict(base)
    other.update(
        values=base["values"].clone(),
        dtype=torch.ones(3, dtype=torch.float64),
        shape=torch.ones(2, 2),
        kind=7,
        obj={"lr": 0.2},
    )
    other["values"][500] = 1.001
    del other["only_a"]
    other["only_b"] = torch.zeros(1)
    torch.save(base, tmp_path / "a.pt")
    torch.save(other, tmp_path / "b.pt")
    torch_save_to_dcp(tmp_path / "b.pt", tmp_path / "b_dcp")
    with open_checkpoint(tmp_path / "a.pt") as a, open_checkpoint(tmp_path / "b_dcp") as b:
        r = diff(a, b)
        assert not r.equal
        assert r.only_a == ["only_a"] and r.only_b == ["only_b"]
        assert r.kind == [("kind", "tensor", "bytes")]
        assert r.dtype == [("dtype", "float32", "float64")]
        assert r.shape == [("shape", [4], [2, 2])]
        assert [(v.fqn, v.mismatched, v.count) for v in r.values] == [("values", 1, 1000)]
        assert r.values[0].max_abs == pytest.approx(0.001, rel=1e-3)
        assert r.objects == ["obj.lr"]
        loose = diff(a, b, rtol=0.01)
        assert loose.values == []


def test_diff_equal_across_formats(tmp_path: Path) -> None:
    t = {"w": torch.randn(64, 64), "b": torch.tensor([math.nan, 2.0]).bfloat16()}
    torch.save(t, tmp_path / "a.pt")
    save_file(t, tmp_path / "a.safetensors")
    torch_save_to_dcp(tmp_path / "a.pt", tmp_path / "d")
    with open_checkpoint(tmp_path / "a.safetensors") as s, open_checkpoint(tmp_path / "d") as d:
        r = diff(s, d, budget=1024)
        assert r.equal and r.compared == 2
