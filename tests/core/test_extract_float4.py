"""Exporting a packed ``float4_e2m1fn_x2`` tensor (the value explorer's Export): ``.npy`` holds its
decoded values (NumPy has no 4-bit float), two per byte along the last dimension, low nibble first;
``.pt`` holds the tensor itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dcpstudio.core import export_tensor, open_checkpoint

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _value(nibble: int) -> float:
    return -_E2M1[nibble & 7] if nibble & 8 else _E2M1[nibble]


@pytest.mark.parametrize("shape", [(3, 5), ()])
def test_float4_exports_its_values_to_npy_and_itself_to_pt(tmp_path: Path, shape: tuple[int, ...]) -> None:
    raw = torch.arange(15, dtype=torch.uint8).mul(37).reshape(3, 5)
    raw = raw if shape else raw[1, 2]
    t = raw.view(torch.float4_e2m1fn_x2)
    torch.save({"w": t}, tmp_path / "w.pt")
    ckpt = open_checkpoint(tmp_path / "w.pt")
    with pytest.warns(UserWarning, match="low nibble first"):
        res = export_tensor(ckpt, "w", tmp_path / "w.npy", budget=4)  # blocks cut rows: order kept
    want = np.array([[_value(b & 15), _value(b >> 4)] for b in raw.reshape(-1).tolist()], dtype=np.float32)
    got = np.load(tmp_path / "w.npy")
    assert got.shape == ((*shape[:-1], 2 * shape[-1]) if shape else (2,))
    assert np.array_equal(got.reshape(-1), want.reshape(-1)) and res.nbytes == got.nbytes
    export_tensor(ckpt, "w", tmp_path / "w2.pt")
    back = torch.load(tmp_path / "w2.pt", weights_only=True)
    assert back.dtype == torch.float4_e2m1fn_x2 and torch.equal(back.view(torch.uint8), raw)
