"""Offline resharding (``convert --for-ranks``): a DCP laid out for N ranks, checked against torch's
own ``dcp.save`` of the same DTensors and loaded with torch's own ``dcp.load`` on N gloo ranks."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.cli.main import main
from dcpstudio.core import CancelToken, convert, open_checkpoint
from dcpstudio.core.errors import CancelledError, DestinationExistsError
from dcpstudio.core.ops.convert import reshard, reshard_manifest
from dcpstudio.core.ops.convert.layouts import target_chunks
from dcpstudio.core.ops.integrity import digests
from dcpstudio.core.ops.integrity.manifests import read_manifest
from dcpstudio.core.ranks.launch import launch
from tests import _ranks


def _metadata(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path)).read_metadata()


def _layout(path: Path) -> tuple[dict[str, Any], dict[tuple[str, tuple[int, ...]], str]]:
    """Each tensor's (dtype, size, sorted chunk boxes) or "bytes", and the file of each chunk."""
    md = _metadata(path)
    entries: dict[str, Any] = {}
    for fqn, smd in md.state_dict_metadata.items():
        chunks = getattr(smd, "chunks", None)
        entries[fqn] = (
            "bytes"
            if chunks is None
            else (smd.properties.dtype, tuple(smd.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks))
        )
    files = {(k.fqn, tuple(k.offset or ())): v.relative_path for k, v in md.storage_data.items()}
    return entries, files


def _same_layout_as_torch(ours: Path, torchs: Path, layout: str, mesh: tuple[int, ...]) -> None:
    """The chunks torch's planner recorded for DTensors of ``layout`` on ``mesh``, and each chunk
    that one rank holds in that rank's file; a shared one in its lowest holder's file."""
    mine, my_files = _layout(ours)
    theirs, their_files = _layout(torchs)
    assert mine == theirs
    for fqn, entry in mine.items():
        if entry == "bytes":
            assert my_files[(fqn, ())] == "__0_0.distcp"
            continue
        for c in target_chunks(entry[1], layout, mesh):
            assert my_files[(fqn, c.offsets)] == f"__{c.ranks[0]}_0.distcp"
            if len(c.ranks) == 1:
                assert their_files[(fqn, c.offsets)] == my_files[(fqn, c.offsets)]


def _recorded(path: Path) -> dict[str, str]:
    """Each tensor's digest as the manifest of ``path`` records it."""
    found = read_manifest(path)
    assert found is not None, path
    return {fqn: record["digest"] for fqn, record in found.tensors.items()}


def _hashed(path: Path) -> dict[str, str]:
    """Each tensor's digest as ``dcpstudio hash`` computes it from the checkpoint's bytes."""
    with open_checkpoint(path) as ckpt:
        return {d.fqn: d.digest for d in digests(ckpt) if d.kind == "tensor"}


@pytest.fixture(scope="module")
def resharded(multirank_dcp: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """3 ranks (torch's save) -> 2 ranks shard0, loaded on 2; torch's 2-rank save of that -> 4 ranks
    fsdp on a 2x2 mesh, loaded on 4. One spawn per world size."""
    tmp = tmp_path_factory.mktemp("reshard")
    assert main(["convert", str(multirank_dcp), str(tmp / "r2"), "--for-ranks", "2", "-q"]) == 0  # with its manifest
    two = launch(_ranks.load_resharded, (str(tmp / "r2"), "shard0", (2,), str(tmp / "t2")), nprocs=2, timeout=120)
    convert(tmp / "t2", tmp / "r4", to="dcp", for_ranks=4, layout="fsdp", mesh="2x2", manifest=False)
    four = launch(_ranks.load_resharded, (str(tmp / "r4"), "fsdp", (2, 2), str(tmp / "t4")), nprocs=4, timeout=120)
    return {"tmp": tmp, "two": two, "four": four}


def test_three_ranks_to_two_loads_exactly_each_rank_from_its_file(
    resharded: dict[str, Any], multirank_dcp: Path
) -> None:
    tmp = resharded["tmp"]
    assert _recorded(tmp / "r2") == _hashed(multirank_dcp)  # the source's 3 ranks' chunks, the copy's 2
    assert sorted(p.name for p in (tmp / "r2").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "dcpstudio-manifest.json"
    ]  # fmt: skip
    assert sorted(p.name for p in (tmp / "r4").iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    _same_layout_as_torch(tmp / "r2", tmp / "t2", "shard0", (2,))
    for rank, got in enumerate(resharded["two"]):
        assert got["wrong"] == []
        assert got["tensors_opened"] == [f"__{rank}_0.distcp"]  # its tensors: its own file, one open
        # the non-tensor values (step, extra.*), which every rank loads, are stored once: in rank 0's file
        assert got["opened"] == sorted({"__0_0.distcp", f"__{rank}_0.distcp"})
        assert got["opens"] == len(got["opened"])


def test_two_ranks_to_a_2x2_fsdp_mesh_loads_exactly(resharded: dict[str, Any]) -> None:
    tmp = resharded["tmp"]
    _same_layout_as_torch(tmp / "r4", tmp / "t4", "fsdp", (2, 2))
    # 1-D tensors are replicated over the mesh's second dimension: rows (0, 1) in rank 0's file, (2, 3) in rank 2's
    shared = {0: "__0_0.distcp", 1: "__0_0.distcp", 2: "__2_0.distcp", 3: "__2_0.distcp"}
    for rank, got in enumerate(resharded["four"]):
        assert got["wrong"] == []
        assert got["tensors_opened"] == sorted({f"__{rank}_0.distcp", shared[rank]})
        assert got["opened"] == sorted({f"__{rank}_0.distcp", shared[rank], "__0_0.distcp"})


def test_selection_casts_bands_and_any_source(
    multirank_dcp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--include/--dtype apply; chunks larger than a band are streamed band by band; a torch.save
    source is laid out too. Checked with the files' own reader (torch's runs in the spawned tests)."""
    monkeypatch.setattr(reshard, "BAND", 40)  # every chunk of more than 40 bytes in several bands
    dst = tmp_path / "bf"
    result = convert(multirank_dcp, dst, to="dcp", for_ranks=3, layout="shard1", include=r"^model\.", dtype="bf16")
    assert result.notes == ()
    assert _recorded(dst) == _hashed(dst)  # the manifest holds what was written: the cast tensors
    with open_checkpoint(multirank_dcp) as src, open_checkpoint(dst) as out:
        assert sorted(out.entries) == sorted(f for f in src.entries if f.startswith("model."))
        for fqn in out.entries:
            want = src.read_tensor(fqn).to(torch.bfloat16)
            assert torch.equal(out.read_tensor(fqn), want), fqn
            shape = out.entries[fqn].shape or ()
            files = {c.offsets: c.file for c in out.chunks(fqn)}
            assert files == {c.offsets: f"__{c.ranks[0]}_0.distcp" for c in target_chunks(shape, "shard1", (3,))}
    pt = tmp_path / "model.pt"
    torch.save(_ranks.loadable_state_dict(), pt)
    convert(pt, tmp_path / "pt4", for_ranks=4, layout="fsdp", mesh="2x2", manifest=False)
    with open_checkpoint(pt) as src, open_checkpoint(tmp_path / "pt4") as out:
        assert sorted(out.entries) == sorted(src.entries)
        for fqn, entry in src.entries.items():
            if entry.kind == "tensor":
                assert torch.equal(out.read_tensor(fqn), src.read_tensor(fqn)), fqn
            else:
                assert out.read_value(fqn) == src.read_value(fqn)
        assert max(len(out.chunks(f)) for f in out.entries if out.entries[f].kind == "tensor") == 4


def test_the_manifest_is_any_layouts_and_check_finds_a_flipped_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resharded copy's manifest records what a one-file DCP of the same tensors records, digests
    and moments (both are of the canonical bytes: 16 MiB pieces cut across rows, chunks and files,
    a piece read back as soon as its rows are written under shard0); `check` verifies the copy
    alone and finds a flipped byte; `verify SRC DST` agrees with it."""
    g = torch.Generator().manual_seed(3)
    pt = tmp_path / "m.pt"
    torch.save(
        {"big": torch.randn(1000, 9001, generator=g), "w": torch.randn(9, 10, generator=g).bfloat16(),
         "i": torch.arange(60).reshape(6, 10), "s": torch.tensor(2.5), "e": torch.zeros(0, 4), "step": 3},
        pt,
    )  # fmt: skip
    convert(pt, tmp_path / "one", to="dcp")
    want = read_manifest(tmp_path / "one").tensors  # type: ignore[union-attr]
    assert _recorded(tmp_path / "one") == _hashed(pt)
    for name, layout, n, mesh in (("s0", "shard0", 2, None), ("s1", "shard1", 3, None), ("f", "fsdp", 4, "2x2")):
        convert(pt, tmp_path / name, for_ranks=n, layout=layout, mesh=mesh)
        assert read_manifest(tmp_path / name).tensors == want, layout  # type: ignore[union-attr]
    dst = tmp_path / "s1"
    assert main(["check", str(dst)]) == 0
    assert main(["verify", str(pt), str(dst)]) == 0
    data = dst / "__2_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1  # a mantissa bit of big's last third: nothing a reader refuses
    data.write_bytes(raw)
    capsys.readouterr()
    assert main(["check", str(dst)]) == 1
    assert "__2_0.distcp" in capsys.readouterr().out


def test_a_layout_for_more_ranks_than_descriptors_allowed(tmp_path: Path) -> None:
    """A piece of `x` lies in all 300 ranks' files: the read-back keeps few open (it held one per
    file, past the usual limit of 1,024 for a layout for thousands of ranks)."""
    resource = pytest.importorskip("resource")
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd")
    pt = tmp_path / "m.pt"
    torch.save({"w": torch.randn(300, 2), "x": torch.randn(2, 300)}, pt)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 200, hard))
    try:
        convert(pt, tmp_path / "r", for_ranks=300, layout="shard1")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert _recorded(tmp_path / "r") == _hashed(pt)


def test_bands_tile_a_box_in_row_major_order() -> None:
    box = ((1, 2, 0), (5, 3, 4))
    for limit in (4, 8, 20, 50, 1 << 20):
        got = reshard.bands(*box, 4, limit)
        cells = [
            (a + i, b + j, c + k)
            for (a, b, c), (n, m, q) in got
            for i, j, k in itertools.product(range(n), range(m), range(q))
        ]
        assert cells == list(itertools.product(range(1, 6), range(2, 5), range(0, 4)))
        assert all(n * m * q * 4 <= max(limit, 4) for _, (n, m, q) in got)
    assert reshard.bands((), (), 4) == [((), ())] and reshard.bands((0, 0), (0, 3), 4) == []


def test_overwrite_and_cancel_leave_nothing_half_written(
    multirank_dcp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dst = tmp_path / "r"
    convert(multirank_dcp, dst, for_ranks=2, manifest=False)  # a DCP source's default target (torch.save) is a DCP here
    with pytest.raises(DestinationExistsError):
        convert(multirank_dcp, dst, for_ranks=2, to="dcp", manifest=False)
    before = pickle.dumps(_layout(dst))
    token = CancelToken()

    def cancel_after_first(p: Any) -> None:
        token.cancel()

    with pytest.raises(CancelledError):
        convert(multirank_dcp, dst, for_ranks=3, to="dcp", overwrite=True, progress=cancel_after_first, cancel=token)
    assert pickle.dumps(_layout(dst)) == before  # untouched
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("dcpstudio-digest", "dcpstudio-sha"))]
    late = CancelToken()  # a 2-D tensor under shard1 is read back once its last chunk is written: cancel then
    read_piece = reshard_manifest.RankedReadBack._piece

    def cancelling(self: Any, *args: Any) -> Any:
        time.sleep(0.1)  # after the last item's own check
        late.cancel()
        time.sleep(0.2)
        return read_piece(self, *args)

    monkeypatch.setattr(reshard_manifest.RankedReadBack, "_piece", cancelling)
    with pytest.raises(CancelledError):
        convert(multirank_dcp, dst, for_ranks=3, layout="shard1", include=r"^model\.w$", overwrite=True, cancel=late)
    assert pickle.dumps(_layout(dst)) == before
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # no temporary left
    convert(multirank_dcp, dst, for_ranks=3, to="dcp", overwrite=True, manifest=False)
    assert sorted(p.name for p in dst.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--to", "torch"], "--for-ranks writes a DCP checkpoint, not a torch.save file"),
        (["--files", "2"], "--files and --max-file-size do not apply with --for-ranks"),
        (["--max-file-size", "1MB"], "--files and --max-file-size do not apply with --for-ranks"),
        (["--mesh", "2x2"], "mesh 2x2 needs 4 ranks"),
        (["--mapping", "llama", "--config", "c.json"], "--for-ranks does not combine with --mapping"),
    ],
)
def test_options_that_cannot_apply_are_refused_in_one_line(
    multirank_dcp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["convert", str(multirank_dcp), str(tmp_path / "out"), "--for-ranks", "3", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_layout_without_for_ranks_and_a_dot_pt_destination_are_refused(
    multirank_dcp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["convert", str(multirank_dcp), str(tmp_path / "o"), "--layout", "fsdp"]) == 2
    assert main(["convert", str(multirank_dcp), str(tmp_path / "o.pt"), "--for-ranks", "2"]) == 2
    assert main(["convert", str(multirank_dcp), str(tmp_path / "o"), "--for-ranks", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "dcpstudio: error: --layout and --mesh apply with --for-ranks only",
        "dcpstudio: error: --for-ranks writes a DCP checkpoint, not a torch.save file; drop --to or change the "
        "destination",
        "dcpstudio: error: --for-ranks 0: needs at least 1 rank",
    ]


def test_for_ranks_on_ranks_is_refused_before_anything_is_written(multirank_dcp: Path, tmp_path: Path) -> None:
    """From Python too (the CLI refuses --ranks and torchrun): planning it for the ranks wrote it."""
    from dcpstudio.core.ranks.convert import run_convert

    with pytest.raises(ValueError, match="runs on one process"):
        run_convert(multirank_dcp, tmp_path / "r", ranks=2, for_ranks=2)
    assert list(tmp_path.iterdir()) == []


def test_rank_regions_are_torchs_for_uneven_and_empty_shards() -> None:
    """Against the function DTensor's checkpointing calls for a rank's chunk (private to torch: this
    test follows it where it moves), over shapes that leave ranks short or empty."""
    utils = pytest.importorskip("torch.distributed.tensor._utils")
    from dcpstudio.core.ops.convert.layouts import LAYOUTS, rank_region, shard_dims
    from dcpstudio.core.ranks.load import placements

    for shape, mesh, layout in itertools.product(
        [(), (1,), (2, 3), (5, 7), (3, 1, 2), (0, 4)], [(1,), (3,), (4,), (2, 2), (3, 2)], LAYOUTS
    ):
        dims = shard_dims(layout, len(shape), len(mesh))
        for coordinate in itertools.product(*(range(m) for m in mesh)):
            sizes, offsets = utils._compute_local_shape_and_global_offset(
                shape, mesh, list(coordinate), placements(layout, len(shape), len(mesh))
            )
            assert rank_region(shape, dims, mesh, coordinate) == (tuple(offsets), tuple(sizes)), (shape, mesh, layout)
