"""2-D slices of N-D tensors: windows equal torch's own indexing in every format and layout, and a
slice's summary (bin means, range, histogram) equals a float64 computation over the whole slice."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from dcpstudio.core import convert, open_checkpoint
from dcpstudio.core.ops.explore.slices import SliceSpec, read_window, summarise_slice


def _index(t: torch.Tensor, spec: SliceSpec) -> torch.Tensor:
    """The slice by torch's indexing: rows × columns."""
    idx: list[object] = [slice(None) if d in (spec.rows, spec.cols) else i for d, i in enumerate(spec.index)]
    out = t[tuple(idx)] if t.dim() else t
    if spec.rows is None:
        return out.reshape(1, 1)
    if spec.cols is None:
        return out.reshape(-1, 1)
    return out if spec.rows < spec.cols else out.t()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    g = torch.Generator().manual_seed(5)
    state = {
        "x4": torch.randn(9, 5, 6, 7, generator=g),
        "b3": torch.randn(11, 4, 13, generator=g).bfloat16(),
        "i2": torch.randint(-50, 50, (17, 23), generator=g),
        "v1": torch.randn(31, generator=g),
        "s0": torch.tensor(2.5),
    }
    root = tmp_path_factory.mktemp("slices")
    torch.save(state, root / "s.pt")
    convert(root / "s.pt", root / "s_dcp", to="dcp")
    convert(root / "s.pt", root / "s_split", to="dcp", max_file_size=3000)
    convert(root / "s.pt", root / "s.safetensors", to="safetensors")
    convert(root / "s.pt", root / "shards", to="safetensors", max_shard_size=2000)
    return {
        "torch": root / "s.pt",
        "dcp": root / "s_dcp",
        "dcp-split": root / "s_split",
        "safetensors": root / "s.safetensors",
        "shards": root / "shards",
    }


@pytest.mark.parametrize("kind", ["torch", "dcp", "dcp-split", "safetensors", "shards"])
def test_windows_equal_torch_indexing(sources: dict[str, Path], kind: str) -> None:
    rng = random.Random(kind)
    state = torch.load(sources["torch"], weights_only=True)
    with open_checkpoint(sources[kind]) as ckpt:
        for fqn, t in state.items():
            shape = tuple(t.shape)
            for _ in range(6):
                if not shape:
                    spec = SliceSpec.default(shape)
                else:
                    rows = rng.randrange(len(shape))
                    others = [d for d in range(len(shape)) if d != rows]
                    cols = rng.choice([*others, None]) if others else None
                    index = tuple(rng.randrange(s) for s in shape)
                    spec = SliceSpec(shape, rows, cols, index)
                whole = _index(t, spec)
                r0 = rng.randrange(spec.n_rows)
                c0 = rng.randrange(spec.n_cols)
                r1, c1 = r0 + rng.randrange(1, 9), c0 + rng.randrange(1, 9)
                got = read_window(ckpt, fqn, spec, r0, r1, c0, c1)
                assert torch.equal(got, whole[r0:r1, c0:c1]), (fqn, spec, r0, r1, c0, c1)


def test_slice_specs_are_checked() -> None:
    with pytest.raises(ValueError, match="indices"):
        SliceSpec((3, 4), 0, 1, (0,))
    with pytest.raises(ValueError, match="different"):
        SliceSpec((3, 4), 1, 1, (0, 0))
    with pytest.raises(ValueError, match="out of range"):
        SliceSpec((3, 4, 5), 0, 1, (0, 0, 5))
    spec = SliceSpec((3, 4, 5), 2, 0, (0, 3, 0))
    assert spec.label() == "[:, 3, :]" and spec.free == [1] and (spec.n_rows, spec.n_cols) == (5, 3)


@pytest.mark.parametrize("budget", [64, 32 << 20])
def test_summary_equals_a_float64_reference(tmp_path: Path, budget: int) -> None:
    g = torch.Generator().manual_seed(1)
    t = torch.randn(37, 3, 29, generator=g)
    t[4, 1, 7], t[5, 1, 3], t[30, 1, 28] = math.nan, math.inf, -math.inf
    torch.save({"t": t}, tmp_path / "t.pt")
    spec = SliceSpec(tuple(t.shape), 2, 0, (0, 1, 0))  # rows: dim 2, columns: dim 0
    with open_checkpoint(tmp_path / "t.pt") as ckpt:
        s = summarise_slice(ckpt, "t", spec, max_bins=(8, 5), hist_bins=10, budget=budget)
    x = _index(t, spec).double()
    finite = torch.isfinite(x)
    assert (s.count, s.finite) == (x.numel(), int(finite.sum()))
    assert s.min == float(x[finite].min()) and s.max == float(x[finite].max())
    assert s.row_edges[0] == 0 and s.row_edges[-1] == 29 and len(s.row_edges) == 9
    assert s.col_edges[-1] == 37 and len(s.col_edges) == 6
    for i in range(8):
        for j in range(5):
            block = x[s.row_edges[i] : s.row_edges[i + 1], s.col_edges[j] : s.col_edges[j + 1]]
            good = block[torch.isfinite(block)]
            assert s.heat[i][j] == pytest.approx(float(good.mean()), rel=1e-12)
    assert sum(s.hist_counts) == int(finite.sum()) and len(s.hist_edges) == 11
