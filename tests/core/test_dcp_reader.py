"""DCPReader reads any region of any stored tensor, touching only the chunks it needs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcpstudio.core import DCPReader, read_metadata, torch_save_to_dcp
from dcpstudio.core.formats.dcp.planners import RegionPlanner
from dcpstudio.core.io.raw import contiguous_span
from tests import _ranks


def read_region(ckpt: Path, fqn: str, offsets: list[int], sizes: list[int]) -> tuple[torch.Tensor, int]:
    md = read_metadata(ckpt)
    tmd = md.state_dict_metadata[fqn]
    assert isinstance(tmd, TensorStorageMetadata)
    reader = DCPReader(ckpt)
    reader.set_up_storage_reader(md, True)
    items = create_read_items_for_chunk_list(fqn, tmd, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))])
    target = torch.full(sizes, -1, dtype=tmd.properties.dtype)
    reader.read_data(LoadPlan(items), RegionPlanner(target)).wait()
    return target, reader.bytes_read


def _box(shape: tuple[int, ...]) -> st.SearchStrategy[tuple[list[int], list[int]]]:
    def pick(dim: int) -> st.SearchStrategy[tuple[int, int]]:
        return st.integers(0, dim - 1).flatmap(lambda o: st.tuples(st.just(o), st.integers(1, dim - o)))

    return st.tuples(*[pick(d) for d in shape]).map(lambda b: ([o for o, _ in b], [n for _, n in b]))


@pytest.mark.parametrize("name", ["model.w", "model.v", "model.bf"])
def test_regions_of_sharded_tensors(multirank_dcp: Path, name: str) -> None:
    full = _ranks.full_tensor(name)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_box(tuple(full.shape)))
    def check(box: tuple[list[int], list[int]]) -> None:
        offsets, sizes = box
        got, _ = read_region(multirank_dcp, name, offsets, sizes)
        assert torch.equal(got, narrow_tensor_by_index(full, offsets, sizes))

    check()


def test_row_range_of_a_contiguous_chunk_reads_only_those_bytes(tmp_path: Path) -> None:
    big = torch.arange(1000 * 64, dtype=torch.float32).reshape(1000, 64)
    torch.save({"big": big}, tmp_path / "a.pt")
    torch_save_to_dcp(tmp_path / "a.pt", tmp_path / "d")
    got, nbytes = read_region(tmp_path / "d", "big", [100, 0], [10, 64])
    assert torch.equal(got, big[100:110])
    assert nbytes == 10 * 64 * 4


@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=4).flatmap(
        lambda shape: st.tuples(st.just(shape), _box(tuple(shape)))
    )
)
def test_contiguous_span_matches_brute_force(case: tuple[list[int], tuple[list[int], list[int]]]) -> None:
    shape, (offsets, lengths) = case
    index = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    region = narrow_tensor_by_index(index, offsets, lengths).reshape(-1)
    span = contiguous_span(shape, offsets, lengths)
    is_run = bool(torch.equal(region, torch.arange(int(region[0]), int(region[0]) + region.numel())))
    assert (span is not None) == is_run
    if span is not None:
        assert span == (int(region[0]), region.numel())
