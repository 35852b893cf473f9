"""The same tensor has the same digest in torch.save (any view), DCP (3 ranks, any chunks) and
safetensors, and across a re-shard; a changed element changes it."""

from __future__ import annotations

from pathlib import Path

import torch

from dcpstudio.core import convert, open_checkpoint
from dcpstudio.core.ops.integrity import digests, tensor_digest, value_digest
from tests import _ranks


def _digests(path: Path, budget: int = 1 << 25) -> dict[str, str]:
    with open_checkpoint(path) as ckpt:
        return {d.fqn: d.digest for d in digests(ckpt, budget=budget)}


def test_same_digest_in_every_format_and_across_ranks(multirank_dcp: Path, tmp_path: Path) -> None:
    full = {name: _ranks.full_tensor(name) for name in _ranks.SHAPES}
    torch.save(full, tmp_path / "full.pt")
    convert(tmp_path / "full.pt", tmp_path / "full.safetensors")
    want = _digests(tmp_path / "full.pt")
    assert want["model.w"].startswith("sha256-tree:") and len(set(want.values())) == len(want)
    assert _digests(tmp_path / "full.safetensors") == want
    got = _digests(multirank_dcp)  # Shard(0), Shard(1), replicated, one rank holding nothing
    assert {k: got[k] for k in want} == want
    assert _digests(multirank_dcp, budget=64) == got  # row-major blocks across chunk borders


def test_views_and_reshards_keep_digests(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(30, 40, generator=g)
    torch.save({"t": base.t()[2:30:3], "s": base[5:9]}, tmp_path / "views.pt")  # strided, offset
    torch.save({"t": base.t()[2:30:3].clone(), "s": base[5:9].clone()}, tmp_path / "plain.pt")
    want = _digests(tmp_path / "plain.pt")
    assert _digests(tmp_path / "views.pt") == want
    convert(tmp_path / "views.pt", tmp_path / "a.dcp", to="dcp", files=2)
    convert(tmp_path / "a.dcp", tmp_path / "b.st", to="safetensors", max_shard_size=2000)
    assert _digests(tmp_path / "a.dcp") == want == _digests(tmp_path / "b.st")
    changed = base.t()[2:30:3].clone()
    changed[0, 0] += 1
    torch.save({"t": changed}, tmp_path / "changed.pt")
    with open_checkpoint(tmp_path / "changed.pt") as ckpt:
        assert tensor_digest(ckpt, "t").digest != want["t"]


def test_dtype_and_shape_are_part_of_the_digest(tmp_path: Path) -> None:
    x = torch.zeros(4, 6)
    torch.save({"a": x, "b": x.reshape(6, 4), "c": x.to(torch.int32)}, tmp_path / "m.pt")
    assert len(set(_digests(tmp_path / "m.pt").values())) == 3


def test_value_digests_are_canonical() -> None:
    assert value_digest({"lr": 0.1, "betas": (0.9, 0.99)}) == value_digest({"betas": (0.9, 0.99), "lr": 0.1})
    assert value_digest((1, 2)) != value_digest([1, 2])
    assert value_digest(1) != value_digest(1.0) != value_digest("1")
    assert value_digest(float("nan")) == value_digest(float("nan"))
