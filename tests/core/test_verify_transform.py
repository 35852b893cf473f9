"""``verify`` through a conversion's transform: the source as the conversion wrote it (kept
entries, new names, casts by torch) equals the output exactly, and a value the conversion got wrong
-- even by one rounding step of the cast -- still shows; options that cannot have made the output
are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import DCPStudioError, EmptySelectionError, convert
from dcpstudio.core.ops.convert.transform import Transform
from dcpstudio.core.ops.verify import verify


@pytest.fixture
def src(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    state = {
        "model.a": torch.randn(4, 3, generator=g),
        "model.b": torch.randn(5, generator=g).double(),
        "model.i": torch.arange(6),
        "model.h": torch.randn(3, generator=g).to(torch.bfloat16),
        "optim.m": torch.randn(2, generator=g),
        "step": 3,
    }
    torch.save(state, tmp_path / "src.pt")
    return tmp_path / "src.pt"


@pytest.mark.parametrize(("dst", "to"), [("out.safetensors", "safetensors"), ("out_dcp", "dcp"), ("out.pt", "torch")])
def test_filtered_cast_output_equals_source_through_its_transform(src: Path, dst: str, to: Any) -> None:
    prefix = "model." if to == "safetensors" else None
    out = src.parent / dst
    result = convert(src, out, to=to, include=r"^model\.", dtype="bf16", strip_prefix=prefix)
    assert result.transform == Transform(r"^model\.", None, "bf16", prefix)
    checked = verify(src, out, result.transform)
    assert checked.equal and checked.report.compared == 4 and not checked.report.only_a
    assert (checked.kept, checked.entries) == (4, 6)
    whole = verify(src, out)  # the whole, uncast source: what the window used to compare with
    assert not whole.equal and len(whole.report.only_a) >= 2


def test_a_cast_rounded_otherwise_is_a_difference(src: Path, tmp_path: Path) -> None:
    """Truncating to bf16 instead of rounding to nearest is off by one bf16 step: through the cast
    it is reported, where a tolerance of the cast's rounding would let it pass."""
    state = torch.load(src, weights_only=True)
    a = state["model.a"]
    truncated = (a.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(truncated, a.to(torch.bfloat16))
    torch.save({"model.a": truncated}, tmp_path / "bad.pt")
    checked = verify(src, tmp_path / "bad.pt", Transform(include=r"^model\.a$", dtype="bf16"))
    assert not checked.equal and [v.fqn for v in checked.report.values] == ["model.a"]


def test_options_that_cannot_apply_are_refused(src: Path, tmp_path: Path) -> None:
    convert(src, tmp_path / "out.pt", include=r"^model\.")
    with pytest.raises(ValueError, match="--strip-prefix applies to safetensors outputs only"):
        verify(src, tmp_path / "out.pt", Transform(strip_prefix="model."))
    convert(src, tmp_path / "out.safetensors", to="safetensors", include=r"^model\.")
    with pytest.raises(ValueError, match=r"--strip-prefix 'zzz\.' starts no entry"):
        verify(src, tmp_path / "out.safetensors", Transform(strip_prefix="zzz."))
    with pytest.raises(EmptySelectionError, match="--include 'zzz' matches no entry"):
        verify(src, tmp_path / "out.pt", Transform(include="zzz"))
    with pytest.raises(ValueError, match="unknown dtype"):
        Transform(dtype="int8")  # type: ignore[arg-type]


def test_names_that_become_one_are_refused(tmp_path: Path) -> None:
    torch.save({"model.w": torch.ones(1), "w": torch.ones(1)}, tmp_path / "two.pt")
    torch.save({"w": torch.ones(1)}, tmp_path / "one.pt")
    from safetensors.torch import save_file

    save_file({"w": torch.ones(1)}, str(tmp_path / "one.safetensors"))
    with pytest.raises(DCPStudioError, match="both become 'w'"):
        verify(tmp_path / "two.pt", tmp_path / "one.safetensors", Transform(strip_prefix="model."))
