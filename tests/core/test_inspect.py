"""open_checkpoint reports what torch wrote: names, dtypes, shapes, chunks and byte ranges."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from dcpstudio.core import UnsafePickleError, open_checkpoint, torch_save_to_dcp
from tests import _ranks
from tests.conftest import dcp_save, rich_state_dict


def _bytes_at(path: Path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_dcp_chunks_point_at_the_bytes_torch_wrote(multirank_dcp: Path) -> None:
    with open_checkpoint(multirank_dcp) as ckpt:
        assert ckpt.format == "dcp"
        assert ckpt.entries["model.w"].shape == (10, 6) and ckpt.entries["model.bf"].dtype == torch.bfloat16
        assert ckpt.entries["step"].kind == "bytes" and ckpt.read_value("step") == 5
        for name in _ranks.SHAPES:
            full = _ranks.full_tensor(name)
            chunks = ckpt.resolve_chunks(name)
            covered = 0
            for c in chunks:
                box = full
                for dim, (o, s) in enumerate(zip(c.offsets, c.sizes, strict=True)):
                    box = box.narrow(dim, o, s)
                assert c.file is not None and c.data_offset is not None
                nbytes = box.numel() * box.element_size()
                assert _bytes_at(multirank_dcp / c.file, c.data_offset, nbytes) == _as_bytes(box)
                assert c.offset is not None and c.length is not None
                assert c.offset <= c.data_offset and c.data_offset + nbytes <= c.offset + c.length
                covered += box.numel()
            assert covered == full.numel()  # replicated tensors are stored once
        # uneven split: rows 4, 4, 2 in three rank files
        w = sorted(ckpt.chunks("model.w"), key=lambda c: c.offsets)
        assert [(c.offsets, c.sizes, c.file) for c in w] == [
            ((0, 0), (4, 6), "__0_0.distcp"),
            ((4, 0), (4, 6), "__1_0.distcp"),
            ((8, 0), (2, 6), "__2_0.distcp"),
        ]


def test_torch_save_storages_and_sharing(rich_pt: Path) -> None:
    sd = rich_state_dict()
    with open_checkpoint(rich_pt) as ckpt:
        assert ckpt.format == "torch"
        e = ckpt.entries
        assert set(e["model.w"].shared_with) == {"model.w_t", "model.w_slice", "model.w_tied"}
        assert e["model.w_slice"].storage == e["model.w"].storage and e["model.w_slice"].storage_offset == 10
        assert e["model.w_t"].stride == (1, 8)
        assert e["name"].kind == "object" and e["name"].value == "run-7"
        (c,) = ckpt.chunks("model.bf16")
        assert c.data_offset is not None and c.data_offset % 64 == 0
        assert _bytes_at(rich_pt, c.data_offset, 5 * 3 * 2) == _as_bytes(sd["model"]["bf16"])
        for fqn in ("model.w_t", "model.w_slice", "model.channels_last", "model.f8", "model.scalar"):
            ref = sd["model"][fqn.split(".")[1]]
            got = ckpt.read_tensor(fqn)
            assert got.dtype == ref.dtype and got.shape == ref.shape and got.is_contiguous()
            assert _as_bytes(got) == _as_bytes(ref)
        assert ckpt.read_value("pair") == (0.5, 3)
        totals = ckpt.totals_by_prefix()
        assert totals["model"].count == 15 and totals["optim"].count == 8


def test_safetensors_file_and_sharded_directory(tmp_path: Path) -> None:
    a = {"emb.weight": torch.randn(8, 4), "norm.weight": torch.ones(4, dtype=torch.bfloat16)}
    b = {"head.weight": torch.arange(12, dtype=torch.int32).reshape(3, 4)}
    save_file(a, tmp_path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(b, tmp_path / "model-00002-of-00002.safetensors")
    import json

    weight_map = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.format == "safetensors" and set(ckpt.entries) == set(a) | set(b)
        for name, ref in (a | b).items():
            (c,) = ckpt.chunks(name)
            assert c.file is not None and c.data_offset is not None
            assert _bytes_at(tmp_path / c.file, c.data_offset, ref.numel() * ref.element_size()) == _as_bytes(ref)
            assert torch.equal(ckpt.read_tensor(name), ref)
        assert torch.equal(ckpt.read_tensor("head.weight", [slice(1, 3), slice(1, 2)]), b["head.weight"][1:3, 1:2])
    with open_checkpoint(tmp_path / "model-00002-of-00002.safetensors") as one:
        assert list(one.entries) == ["head.weight"]


@pytest.mark.parametrize("fmt", ["torch", "dcp", "safetensors"])
def test_partial_reads_match_slices(tmp_path: Path, fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    t = torch.randn(37, 11, 5, generator=g)
    torch.save({"t": t}, tmp_path / "a.pt")
    path = tmp_path / "a.pt"
    if fmt == "dcp":
        torch_save_to_dcp(path, tmp_path / "d")
        path = tmp_path / "d"
    elif fmt == "safetensors":
        save_file({"t": t}, tmp_path / "a.safetensors")
        path = tmp_path / "a.safetensors"
    dims = st.integers(0, 36).flatmap(lambda a: st.tuples(st.just(a), st.integers(a, 37)))
    with open_checkpoint(path) as ckpt:

        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
        @given(dims, st.integers(0, 10), st.integers(0, 11), st.integers(0, 4))
        def check(rows: tuple[int, int], c0: int, c1: int, d0: int) -> None:
            lo, hi = sorted((c0, c1))
            region = [slice(*rows), slice(lo, hi), slice(d0, None)]
            assert torch.equal(ckpt.read_tensor("t", region), t[rows[0] : rows[1], lo:hi, d0:])

        check()
        with pytest.raises(ValueError, match="dimensions"):
            ckpt.read_tensor("t", [slice(None)] * 4)


def test_hostile_inputs_run_nothing_when_inspected(tmp_path: Path) -> None:
    marker = tmp_path / "RAN"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    torch.save({"w": torch.ones(2), "x": Evil()}, tmp_path / "e.pt")
    with pytest.raises(UnsafePickleError):
        open_checkpoint(tmp_path / "e.pt")

    dcp_save({"w": torch.ones(2), "x": Evil()}, checkpoint_id=tmp_path / "d")
    with open_checkpoint(tmp_path / "d") as ckpt:  # the structure opens; the value is refused
        assert ckpt.entries["x"].kind == "bytes"
        with pytest.raises(UnsafePickleError):
            ckpt.read_value("x")
    assert not marker.exists()


def test_large_metadata_opens_without_its_storage_index_then_loads_it(
    multirank_dcp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head-only parse (used for big .metadata files) gives the same model as a full parse,
    even when a tensor is itself named like the metadata field that is cut at."""
    from dcpstudio.core.checkpoints.dcp import metadata as dcp_metadata

    full = open_checkpoint(multirank_dcp)
    monkeypatch.setattr(dcp_metadata, "HEAD_ONLY_ABOVE", 0)
    for child in (False, True):  # the storage index parsed here, then in a child process
        monkeypatch.setattr(dcp_metadata, "CHILD_ABOVE", 0 if child else 1 << 40)
        head = open_checkpoint(multirank_dcp)
        assert not hasattr(head._md, "storage_data")  # type: ignore[attr-defined]
        assert {k: (e.kind, e.dtype, e.shape) for k, e in head.entries.items()} == {
            k: (e.kind, e.dtype, e.shape) for k, e in full.entries.items()
        }
        for fqn in full.entries:
            assert head.chunks(fqn) == full.chunks(fqn)

    tricky = {"storage_data": torch.arange(6.0), "planner_data": {"storage_data": 3}, "x": torch.ones(2)}
    dcp_save(tricky, checkpoint_id=tmp_path / "tricky")
    with open_checkpoint(tmp_path / "tricky") as ckpt:
        assert set(ckpt.entries) == {"storage_data", "planner_data.storage_data", "x"}
        assert torch.equal(ckpt.read_tensor("storage_data"), torch.arange(6.0))
        assert ckpt.read_value("planner_data.storage_data") == 3
