"""Region reads (``Checkpoint.read_tensor(fqn, region)``) return exactly torch's own slicing of the
saved tensor, in every format, and read only about the window's bytes however large the tensor."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter

from dcpstudio.core import open_checkpoint
from dcpstudio.core.io import raw as _io
from tests._chunked import Box, ChunkedPlanner, split
from tests.conftest import dcp_load, dcp_save


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "f32": torch.randn(5, 7, 9, generator=g),
        "bf16": torch.randn(6, 11, generator=g).bfloat16(),
        "i16": torch.randint(-1000, 1000, (4, 3, 5, 6), generator=g, dtype=torch.int16),
        "c64": torch.randn(7, 5, dtype=torch.complex64, generator=g),
        "bool": torch.rand(9, 8, generator=g) > 0.5,
        "f8": torch.randn(3, 12, 4, generator=g).to(torch.float8_e4m3fn),
        "u8": torch.randint(0, 255, (300,), generator=g, dtype=torch.uint8),
    }


def chunk_plan(sd: dict[str, torch.Tensor]) -> dict[str, list[Box]]:
    """Several chunks per tensor, split along dimension 1 too (not only whole-row slabs)."""
    out = {}
    for name, t in sd.items():
        cuts = {0: [t.shape[0] // 2]} if t.dim() == 1 else {0: [t.shape[0] // 3], 1: [1, t.shape[1] // 2 + 1]}
        out[name] = split(tuple(t.shape), cuts)
    return out


def has_safetensors_dcp() -> bool:
    from torch.distributed.checkpoint import filesystem

    return hasattr(getattr(filesystem, "SerializationFormat", None), "SAFETENSORS")


def write(kind: str, sd: dict[str, torch.Tensor], out: Path) -> Path:
    """``sd`` saved as ``kind``; returns the checkpoint's path."""
    if kind == "torch":
        torch.save(sd, out.with_suffix(".pt"))
        return out.with_suffix(".pt")
    if kind == "safetensors":
        save_file(sd, str(out.with_suffix(".safetensors")))
        return out.with_suffix(".safetensors")
    if kind == "safetensors-index":  # whole tensors spread over shards named by an index
        out.mkdir()
        names = sorted(sd)
        weight_map = {n: f"model-{i % 2 + 1:05d}-of-00002.safetensors" for i, n in enumerate(names)}
        for file in set(weight_map.values()):
            save_file({n: sd[n] for n in names if weight_map[n] == file}, str(out / file))
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return out
    if kind == "safetensors-shards":  # torch's distributed HF layout: each file one shard of every tensor
        out.mkdir()
        for rank in range(2):
            pieces, info = {}, {}
            for name, t in sd.items():
                d = t.dim() - 1
                half = t.shape[d] // 2
                start, size = (0, half) if rank == 0 else (half, t.shape[d] - half)
                pieces[name] = t.narrow(d, start, size).contiguous()
                info[name] = {"saved_offsets": [start if k == d else 0 for k in range(t.dim())]}
            save_file(pieces, str(out / f"shard-{rank}.safetensors"), metadata={"DCP_SHARDING_INFO": json.dumps(info)})
        return out
    writer_options: dict[str, Any] = {}
    boxes: dict[str, list[Box]] = {}
    if kind in ("dcp-chunks", "dcp-zstd"):
        boxes = chunk_plan(sd)
    if kind == "dcp-zstd":
        from torch.distributed.checkpoint import _extension as ext

        if not ext.ZStandard.is_available():
            pytest.skip("zstandard is not installed")
        writer_options["_extensions"] = [ext.ZStandard()]
    if kind == "dcp-safetensors":
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        writer_options["serialization_format"] = SerializationFormat.SAFETENSORS
        writer_options["thread_count"] = 2  # one chunk per tensor: a safetensors blob names each tensor once
    dcp_save(sd, storage_writer=FileSystemWriter(str(out), **writer_options), planner=ChunkedPlanner(boxes))
    if kind != "dcp-safetensors":  # torch's own reader agrees with what was saved
        back = {k: torch.empty_like(v) for k, v in sd.items()}
        dcp_load(back, checkpoint_id=str(out))
        assert all(torch.equal(back[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd)
    return out


KINDS = [
    "torch",
    "safetensors",
    "safetensors-index",
    "safetensors-shards",
    "dcp",
    "dcp-chunks",
    pytest.param("dcp-safetensors", marks=pytest.mark.skipif(not has_safetensors_dcp(), reason="torch too old")),
    "dcp-zstd",
]


def windows(shape: tuple[int, ...], rng: random.Random, n: int) -> Iterator[list[slice]]:
    """Random boxes: 2-D windows of an N-D tensor (other dimensions fixed at one index), and boxes
    with random extents in every dimension (some left whole, some as short regions)."""
    for k in range(n):
        region = []
        pair = rng.sample(range(len(shape)), min(2, len(shape)))
        for d, size in enumerate(shape):
            start = rng.randrange(size)
            if k % 2 == 0 and d not in pair:
                stop = start + 1
            elif rng.random() < 0.2:
                start, stop = 0, size
            else:
                stop = rng.randint(start + 1, size)
            region.append(slice(start, stop))
        yield region[: rng.randint(1, len(region))] if k % 5 == 4 else region


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat = [torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1)).view(torch.uint8) for t in (a, b)]
    return torch.equal(*flat)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("thresholds", ["as shipped", "tiny"])
def test_random_windows_equal_torch_slicing(
    kind: str, thresholds: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if thresholds == "tiny":  # small tensors through every way of reading: per run, in bands, covering
        monkeypatch.setattr(_io, "_DENSE_FLOOR", 0)
        monkeypatch.setattr(_io, "_DENSE_RATIO", 1)
        monkeypatch.setattr(_io, "_GAP", 24)
        monkeypatch.setattr(_io, "_BAND", 100)
    sd = tensors()
    if kind.startswith("safetensors") or kind == "dcp-safetensors":
        sd.pop("f8")  # not every safetensors release names float8 the same way
    if kind == "torch":  # views as torch.save keeps them: transposed, channels-last, offset, shared
        base = torch.randn(8, 10, generator=torch.Generator().manual_seed(1))
        sd |= {"t": base.t(), "slice": base[2:7, 1:9], "base": base}
        sd["cl"] = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    path = write(kind, sd, tmp_path / "ckpt")
    rng = random.Random(kind)
    with open_checkpoint(path) as ckpt:
        for name, t in sd.items():
            assert same(ckpt.read_tensor(name), t), name
            for region in windows(tuple(t.shape), rng, 40):
                got = ckpt.read_tensor(name, region)
                assert got.is_contiguous()
                assert same(got, t[tuple(region)]), (name, region)


# -- bytes read ------------------------------------------------------------------------------------
BIG = (2048, 16384)  # bfloat16: 64 MiB, rows of 32 KiB
WINDOW = (64, 32)


class Reads:
    """Every ``preadv`` of this process, and what the kernel says the process read (``rchar``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = self.calls = 0
        real = os.preadv

        def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
            got = real(fd, buffers, offset, *args)
            self.bytes += got
            self.calls += 1
            return got

        monkeypatch.setattr(os, "preadv", preadv)

    @staticmethod
    def rchar() -> int | None:
        try:
            text = Path("/proc/self/io").read_text()
        except OSError:
            return None
        return int(next(line.split()[1] for line in text.splitlines() if line.startswith("rchar:")))


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("big")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(BIG, generator=g).bfloat16()
    cube = torch.randn(64, 512, 1024, generator=g).bfloat16()  # 64 MiB; rows of 2 KiB
    paths = {"torch": out / "w.pt", "safetensors": out / "w.safetensors"}
    torch.save({"w": w, "wt": w.t(), "cube": cube}, paths["torch"])
    save_file({"w": w, "cube": cube}, str(paths["safetensors"]))
    boxes = {"w": split(BIG, {0: [1000], 1: [5000, 9000]}), "cube": split((64, 512, 1024), {1: [200], 2: [600]})}
    paths["dcp-chunks"] = out / "dcp"
    dcp_save(
        {"w": w, "cube": cube}, storage_writer=FileSystemWriter(str(paths["dcp-chunks"])), planner=ChunkedPlanner(boxes)
    )
    if has_safetensors_dcp():
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        paths["dcp-safetensors"] = out / "dcp_st"
        writer = FileSystemWriter(str(paths["dcp-safetensors"]), serialization_format=SerializationFormat.SAFETENSORS)
        dcp_save({"w": w, "cube": cube}, storage_writer=writer)
    return {"w": w, "cube": cube, "paths": paths}


BIG_KINDS = ["torch", "safetensors", "dcp-chunks", "dcp-safetensors"]


@pytest.mark.parametrize("kind", BIG_KINDS)
def test_a_window_of_a_large_tensor_reads_only_about_its_bytes(
    kind: str, big: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    if kind not in big["paths"]:
        pytest.skip("torch too old for DCP with safetensors serialization")
    rng = random.Random(3)
    reads = Reads(monkeypatch)
    names = ["w", "wt"] if kind == "torch" else ["w"]
    with open_checkpoint(big["paths"][kind]) as ckpt:
        for name in names:
            full = big["w"] if name == "w" else big["w"].t()
            ckpt.read_tensor(name, [slice(0, 1), slice(0, 1)])  # chunk headers parsed, modules imported
            for k in range(12):
                r0 = rng.randrange(full.shape[0] - WINDOW[0]) if k else 1000 - WINDOW[0] // 2  # across chunks
                c0 = rng.randrange(full.shape[1] - WINDOW[1]) if k else 5000 - WINDOW[1] // 2
                region = [slice(r0, r0 + WINDOW[0]), slice(c0, c0 + WINDOW[1])]
                before, rchar = reads.bytes, Reads.rchar()
                got = ckpt.read_tensor(name, region)
                read = reads.bytes - before
                assert same(got, full[tuple(region)])
                assert read < 1 << 20, f"{kind} {name}: a {WINDOW} window read {read} bytes"
                after = Reads.rchar()
                if rchar is not None and after is not None:
                    assert after - rchar < 2 << 20, f"{kind} {name}: the process read {after - rchar} bytes"


@pytest.mark.parametrize("kind", BIG_KINDS)
def test_any_2d_slice_of_an_nd_tensor_reads_a_bounded_amount(
    kind: str, big: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows over any two dimensions of a 3-D tensor, the third fixed: the window's bytes plus at
    most 512 bytes per run of contiguous elements (closer runs are read together), plus 64 KiB."""
    if kind not in big["paths"]:
        pytest.skip("torch too old for DCP with safetensors serialization")
    cube = big["cube"]
    rng = random.Random(5)
    reads = Reads(monkeypatch)
    with open_checkpoint(big["paths"][kind]) as ckpt:
        ckpt.read_tensor("cube", [slice(0, 1)] * 3)
        for dims in [(1, 2), (0, 2), (0, 1)]:
            for _ in range(4):
                region = []
                for d, n in enumerate(cube.shape):
                    extent = WINDOW[dims.index(d)] if d in dims else 1
                    start = rng.randrange(n - extent + 1)
                    region.append(slice(start, start + extent))
                before = reads.bytes
                got = ckpt.read_tensor("cube", region)
                assert same(got, cube[tuple(region)])
                runs = 64 * 32 if dims == (0, 1) else 64
                assert reads.bytes - before <= runs * 512 + got.numel() * 2 + (64 << 10), (dims, reads.bytes - before)
