"""``export_tensor``: one tensor of any checkpoint to ``.npy`` / ``.pt``, streamed block by block."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemWriter

from dcpstudio.core import (
    CancelledError,
    CancelToken,
    DestinationExistsError,
    ExportResult,
    Progress,
    export_tensor,
    open_checkpoint,
)
from dcpstudio.core.dtypes import DTYPES
from dcpstudio.core.pickles.tensor_io import numeric
from tests._chunked import ChunkedPlanner, split
from tests.conftest import dcp_save, leftovers

WIDENED = {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"}
ALSO_WIDENED = {"complex32", "float4_e2m1fn_x2"}  # to complex64 / float32, with a note


def every_dtype() -> dict[str, torch.Tensor]:
    """A 3-D tensor of each dtype a checkpoint can hold values of (not quantized ones)."""
    g = torch.Generator().manual_seed(11)
    out = {}
    for name, d in DTYPES.items():
        if d.kind == "q":
            continue
        dtype = getattr(torch, name)
        if d.kind == "b":
            t = torch.rand(3, 4, 5, generator=g) > 0.5
        elif d.kind in "iu":
            t = torch.randint(0, 100, (3, 4, 5), generator=g).to(dtype)
        elif name == "complex32":
            t = torch.randn(3, 4, 5, dtype=torch.complex64, generator=g).to(dtype)
        elif d.pack > 1:  # float4_e2m1fn_x2: torch has no cast to it; every byte is two values
            t = torch.randint(0, 256, (3, 4, 5), generator=g, dtype=torch.uint8).view(dtype)
        else:
            t = (torch.randn(3, 4, 5, generator=g) * 4).to(dtype)
        out[name] = t
    return out


def checkpoint(kind: str, sd: dict[str, torch.Tensor], out: Path) -> Path:
    if kind == "torch":
        torch.save({**sd, "step": 3}, out.with_suffix(".pt"))
        return out.with_suffix(".pt")
    if kind == "safetensors":
        keep = {k: v for k, v in sd.items() if DTYPES[k].safetensors and k != "complex128"}
        save_file(keep, str(out.with_suffix(".safetensors")))
        return out.with_suffix(".safetensors")
    boxes = {k: split(tuple(v.shape), {0: [1], 1: [3]}) for k, v in sd.items()}  # chunks split along dim 1 too
    dcp_save(sd, storage_writer=FileSystemWriter(str(out)), planner=ChunkedPlanner(boxes))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("kind", ["torch", "safetensors", "dcp"])
def test_every_dtype_round_trips_exactly(kind: str, tmp_path: Path) -> None:
    sd = every_dtype()
    path = checkpoint(kind, sd, tmp_path / "ckpt")
    with open_checkpoint(path) as ckpt:
        names = [n for n in sd if n in ckpt.entries]
        assert len(names) >= 15
        for name in names:
            t = sd[name]
            pt = export_tensor(ckpt, name, tmp_path / f"{name}.pt", budget=64)  # several blocks each
            back = torch.load(pt.dst, weights_only=True)
            assert isinstance(back, torch.Tensor) and back.dtype == t.dtype and back.shape == t.shape
            assert torch.equal(bits(back), bits(t)), name
            assert (pt.fmt, pt.dtype, pt.nbytes, pt.notes) == ("pt", name, t.numel() * t.element_size(), ())

            with pytest.warns(UserWarning, match="NumPy has no") if name in WIDENED | ALSO_WIDENED else _nothing():
                npy = export_tensor(ckpt, name, tmp_path / f"{name}.npy", budget=64)
            array = np.load(npy.dst)
            if name == "float4_e2m1fn_x2":  # decoded: two values a byte along the last dimension
                assert array.shape == (3, 4, 10) and npy.dtype == "float32" and len(npy.notes) == 1
                assert torch.equal(torch.from_numpy(array), numeric(t))
                continue
            assert array.shape == tuple(t.shape)
            if name in WIDENED:  # widened, exactly
                assert npy.dtype == "float32" and array.dtype == np.float32 and len(npy.notes) == 1
                assert torch.equal(bits(torch.from_numpy(array)), bits(t.float())), name
            elif name == "complex32":
                assert npy.dtype == "complex64" and array.dtype == np.complex64
                assert torch.equal(torch.from_numpy(array), t.to(torch.complex64))
            else:
                assert npy.dtype == name and npy.notes == ()
                assert torch.equal(bits(torch.from_numpy(array)), bits(t)), name
            assert npy.nbytes == array.nbytes


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_shapes_and_formats(tmp_path: Path) -> None:
    sd = {
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "row": torch.arange(7),
        "bf": torch.ones(2).bfloat16(),
    }
    torch.save(sd, tmp_path / "m.pt")
    with open_checkpoint(tmp_path / "m.pt") as ckpt:
        for name, t in sd.items():
            r = export_tensor(ckpt, name, tmp_path / f"{name}.data", fmt="npy")
            assert r.fmt == "npy" and np.load(r.dst).shape == tuple(t.shape)
            r = export_tensor(ckpt, name, tmp_path / f"{name}.PT")
            assert r.fmt == "pt" and torch.equal(torch.load(r.dst, weights_only=True), t)
        bf = export_tensor(ckpt, "bf", tmp_path / "bf.npy")
        assert bf == ExportResult(tmp_path / "bf.npy", "npy", "float32", 8, bf.notes) and "bfloat16" in bf.notes[0]
        with pytest.raises(ValueError, match=r"cannot export to 'x\.bin'.*choose \.npy or \.pt"):
            export_tensor(ckpt, "row", tmp_path / "x.bin")
        with pytest.raises(ValueError, match="cannot export to format 'csv'"):
            export_tensor(ckpt, "row", tmp_path / "x.npy", fmt="csv")
        with pytest.raises(KeyError, match="no entry named 'nope'"):
            export_tensor(ckpt, "nope", tmp_path / "x.npy")
    torch.save({"w": torch.ones(2), "step": 3}, tmp_path / "v.pt")
    with open_checkpoint(tmp_path / "v.pt") as ckpt, pytest.raises(ValueError) as e:
        export_tensor(ckpt, "step", tmp_path / "step.npy")
    assert str(e.value) == "step is not a tensor; only tensors can be exported"
    assert not (tmp_path / "step.npy").exists() and leftovers(tmp_path) == []


def test_existing_destination(tmp_path: Path) -> None:
    torch.save({"w": torch.arange(6.0)}, tmp_path / "m.pt")
    dst = tmp_path / "w.npy"
    dst.write_bytes(b"old")
    with open_checkpoint(tmp_path / "m.pt") as ckpt:
        with pytest.raises(DestinationExistsError, match="--overwrite"):
            export_tensor(ckpt, "w", dst)
        assert dst.read_bytes() == b"old"
        export_tensor(ckpt, "w", dst, overwrite=True)
        assert np.array_equal(np.load(dst), np.arange(6.0, dtype=np.float32))
        (tmp_path / "d.npy").mkdir()
        with pytest.raises(Exception, match="it is a directory"):
            export_tensor(ckpt, "w", tmp_path / "d.npy", overwrite=True)
        with pytest.raises(Exception, match="is the source"):
            export_tensor(ckpt, "w", tmp_path / "m.pt", overwrite=True)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("fmt", ["npy", "pt"])
def test_cancel_midway_leaves_nothing(fmt: str, tmp_path: Path) -> None:
    torch.save({"w": torch.randn(64, 256)}, tmp_path / "m.pt")
    token = CancelToken()
    seen: list[Progress] = []

    def progress(p: Progress) -> None:
        seen.append(p)
        if p.done_bytes >= p.total_bytes // 2:
            token.cancel()

    dst = tmp_path / f"w.{fmt}"
    with open_checkpoint(tmp_path / "m.pt") as ckpt, pytest.raises(CancelledError):
        export_tensor(ckpt, "w", dst, budget=4096, progress=progress, cancel=token)
    assert 0 < seen[-1].done_bytes < seen[-1].total_bytes == 64 * 256 * 4
    assert not dst.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("fmt", ["npy", "pt"])
def test_a_tensor_larger_than_the_budget_streams(fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read and every write is at most the budget (x2 where bfloat16 is widened to float32)."""
    t = torch.randn(300, 50, 7).bfloat16()  # 210 KB
    torch.save({"w": t}, tmp_path / "m.pt")
    budget = 8 << 10
    reads: list[int] = []
    with open_checkpoint(tmp_path / "m.pt") as ckpt:
        real = ckpt.read_tensor

        def read_tensor(fqn: str, region: Any = None) -> torch.Tensor:
            out = real(fqn, region)
            reads.append(out.numel() * out.element_size())
            return out

        monkeypatch.setattr(ckpt, "read_tensor", read_tensor)
        writes: list[int] = []
        import dcpstudio.core.ops.explore.extract as extract

        opened = extract.create_file

        class Recording:
            def __init__(self, f: Any) -> None:
                self.f = f

            def write(self, data: Any) -> int:
                writes.append(memoryview(data).nbytes)
                return int(self.f.write(data))

            def __getattr__(self, name: str) -> Any:
                return getattr(self.f, name)

            def __enter__(self) -> Any:
                return self

            def __exit__(self, *exc: object) -> None:
                self.f.close()

        monkeypatch.setattr(extract, "create_file", lambda *a, **k: Recording(opened(*a, **k)))
        progress: list[int] = []
        export_tensor(ckpt, "w", tmp_path / f"w.{fmt}", budget=budget, progress=lambda p: progress.append(p.done_bytes))
    total = t.numel() * 2
    assert sum(reads) == total and len(reads) >= total // budget and max(reads) <= budget
    assert max(writes) <= 2 * budget and len(writes) >= len(reads)
    assert progress[-1] == total and len(progress) == len(reads) + 1
    if fmt == "pt":
        assert torch.equal(bits(torch.load(tmp_path / "w.pt", weights_only=True)), bits(t))
    else:
        assert torch.equal(torch.from_numpy(np.load(tmp_path / "w.npy")), t.float())


def test_peak_memory_stays_bounded_for_a_large_tensor(tmp_path: Path) -> None:
    """A 256 MiB tensor exported from DCP grows the process by far less than its size (peak resident
    memory, measured in a fresh process)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to measure peak memory")
    w = torch.randn(4096, 16384)
    dcp_save({"w": w}, storage_writer=FileSystemWriter(str(tmp_path / "dcp")))
    del w
    script = textwrap.dedent(
        f"""
        from dcpstudio.core import export_tensor, open_checkpoint

        def status(key):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) << 10 for line in f if line.startswith(key))

        with open_checkpoint({str(tmp_path / "dcp")!r}) as ckpt:
            ckpt.read_tensor("w", [slice(0, 1)])
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak (VmHWM) starts again from here
            before = status("VmRSS:")
            for fmt in ("npy", "pt"):
                export_tensor(ckpt, "w", {str(tmp_path)!r} + "/w." + fmt)
            print(status("VmHWM:") - before)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    grown = int(proc.stdout.split()[-1])
    print(f"peak RSS grew by {grown >> 20} MiB")
    assert grown < 60 << 20, f"exporting a 256 MiB tensor grew the process by {grown >> 20} MiB (blocks: 32 MiB)"
    assert os.path.getsize(tmp_path / "w.npy") == 128 + (256 << 20)
    back = np.load(tmp_path / "w.npy", mmap_mode="r")
    assert back.shape == (4096, 16384)
