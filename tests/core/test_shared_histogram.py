"""One histogram binning (issue 25, item 14): a tensor's statistics (Details) and the summary of its
whole 2-D slice (Values) give the same edges and counts, whatever the dtype and the reads' strips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpstudio.core import open_checkpoint, tensor_stats
from dcpstudio.core.ops.explore.slices import SliceSpec, summarise_slice


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.bool])
def test_stats_and_slice_summary_bin_alike(tmp_path: Path, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(96, 70, generator=g) * 3).to(dtype) if dtype != torch.bool else torch.rand(96, 70) > 0.3
    if dtype.is_floating_point:
        x[5, 5], x[9, 1] = float("nan"), float("inf")
    torch.save({"x": x}, tmp_path / "x.pt")
    ckpt = open_checkpoint(tmp_path / "x.pt")
    stats = tensor_stats(ckpt, "x", budget=4096)
    summary = summarise_slice(ckpt, "x", SliceSpec.default((96, 70)), budget=2048)
    assert len(stats.hist_counts) > 1
    assert summary.hist_edges == stats.hist_edges
    assert summary.hist_counts == stats.hist_counts
