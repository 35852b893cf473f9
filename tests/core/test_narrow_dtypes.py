"""Every dtype torch has and safetensors names -- float4_e2m1fn_x2 (safetensors ``F4``, counted 4 bits
at a time), float8_e8m0fnu, the fnuz float8s -- read and converted bit-exactly through every format,
each output checked with the format's own reader; what torch has no dtype for is refused in one line."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dcpstudio.core import compare, convert, diff, open_checkpoint, tensor_stats
from dcpstudio.core.errors import UnsupportedFormatError
from tests.conftest import dcp_load

DTYPES = ["float4_e2m1fn_x2", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz"]


def _bits(dtype: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(getattr(torch, dtype))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _header(path: Path) -> dict[str, dict[str, object]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header: dict[str, dict[str, object]] = json.loads(raw[8 : 8 + n])
    return header


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_through_every_format(tmp_path: Path, dtype: str) -> None:
    sd = {"w": _bits(dtype, (3, 4)), "v": _bits(dtype, (6,), 1)}
    torch.save(sd, tmp_path / "a.pt")
    convert(tmp_path / "a.pt", tmp_path / "b", to="dcp")
    convert(tmp_path / "b", tmp_path / "c.safetensors", to="safetensors")
    convert(tmp_path / "c.safetensors", tmp_path / "d.pt", to="torch")
    convert(tmp_path / "d.pt", tmp_path / "e", to="dcp")
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp_load(target, checkpoint_id=tmp_path / "b")
    assert all(_same(target[k], v) for k, v in sd.items())
    with safe_open(tmp_path / "c.safetensors", "pt") as f:
        assert all(_same(f.get_tensor(k), v) for k, v in sd.items())
    loaded = torch.load(tmp_path / "d.pt", weights_only=True)
    assert all(_same(loaded[k], v) for k, v in sd.items())
    for out in ("b", "c.safetensors", "d.pt", "e"):
        with open_checkpoint(tmp_path / "a.pt") as a, open_checkpoint(tmp_path / out) as b:
            assert diff(a, b).equal
            assert all(_same(b.read_tensor(k), v) for k, v in sd.items())


def test_f4_header_counts_four_bit_elements(tmp_path: Path) -> None:
    """safetensors' convention: the header's last dimension is twice torch's (two values a byte)."""
    x = _bits("float4_e2m1fn_x2", (2, 3))
    torch.save({"x": x}, tmp_path / "a.pt")
    convert(tmp_path / "a.pt", tmp_path / "b.safetensors", to="safetensors")
    assert _header(tmp_path / "b.safetensors")["x"]["shape"] == [2, 6]
    with open_checkpoint(tmp_path / "b.safetensors") as ckpt:
        assert ckpt.entries["x"].shape == (2, 3)
        assert ckpt.entries["x"].nbytes == 6


def test_f4_values_compared_and_summarised_as_numbers(tmp_path: Path) -> None:
    x = torch.tensor([[0x21, 0x0F]], dtype=torch.uint8)  # low nibble first: 0.5, 1.0, -6.0, 0.0
    y = x.clone()
    y[0, 0] = 0x31  # 0.5, 1.5
    torch.save({"x": x.view(torch.float4_e2m1fn_x2)}, tmp_path / "a.pt")
    torch.save({"x": y.view(torch.float4_e2m1fn_x2)}, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "a.pt") as a, open_checkpoint(tmp_path / "b.pt") as b:
        (row,) = compare(a, b)
        assert row.status == "different" and row.max_abs == 0.5 and row.first_index == (0, 0)
        stats = tensor_stats(a, "x")
        assert (stats.min, stats.max) == (-6.0, 1.0)


def test_odd_f4_and_6_bit_floats_refused_in_one_line(tmp_path: Path) -> None:
    for code, shape, nbytes, says in (("F4", [3], 2, "divisible by 2"), ("F6_E2M3", [4], 3, "no dtype")):
        header = json.dumps({"x": {"dtype": code, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
        path = tmp_path / f"{code}.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(nbytes))
        with pytest.raises(UnsupportedFormatError, match=says):
            open_checkpoint(path)
    torch.save({"s": _bits("float4_e2m1fn_x2", ())}, tmp_path / "s.pt")
    with pytest.raises(UnsupportedFormatError, match="scalar"):
        convert(tmp_path / "s.pt", tmp_path / "s.safetensors", to="safetensors")
    assert not (tmp_path / "s.safetensors").exists()
