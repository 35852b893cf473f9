"""safetensors in and out: every pair of formats round-trips bit-exactly; shards follow the
Hugging Face index convention; failures leave nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dcpstudio.core import (
    CancelledError,
    CancelToken,
    DCPStudioError,
    convert,
    diff,
    open_checkpoint,
    torch_save_to_dcp,
)
from dcpstudio.core.ops.convert.convert import parse_size
from tests.conftest import leftovers


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(40, 16, generator=g)
    return {
        "model": {
            "emb.weight": base,
            "head.weight": base,  # tied: written twice, consistently
            "w_t": base[:16].t(),
            "bf16": torch.randn(33, 7, generator=g).bfloat16(),
            "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
            "i32": torch.arange(12, dtype=torch.int32).reshape(3, 4),
            "u16": torch.arange(5).to(torch.uint16),
            "mask": torch.tensor([True, False]),
            "scalar": torch.tensor(1.5),
            "empty": torch.zeros(0, 4),
        },
        "step": 3,
        "meta": {"name": "run", "lr": 0.5},
    }


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, Path]:
    pt = tmp_path / "src.pt"
    torch.save(_state(), pt)
    torch_save_to_dcp(pt, tmp_path / "src_dcp")
    with pytest.warns(UserWarning, match="stored 3 value"):
        convert(pt, tmp_path / "src.safetensors", to="safetensors")
    return {"torch": pt, "dcp": tmp_path / "src_dcp", "safetensors": tmp_path / "src.safetensors"}


def _equal(a: Path, b: Path) -> None:
    with open_checkpoint(a) as x, open_checkpoint(b) as y:
        report = diff(x, y)
        assert report.equal, (report.only_a, report.only_b, report.dtype, report.values, report.objects)


@pytest.mark.filterwarnings("ignore:safetensors holds tensors only")
@pytest.mark.parametrize("src_fmt", ["torch", "dcp", "safetensors"])
@pytest.mark.parametrize("dst_fmt", ["torch", "dcp", "safetensors"])
def test_every_pair_round_trips_bit_exactly(
    sources: dict[str, Path], tmp_path: Path, src_fmt: str, dst_fmt: str
) -> None:
    if src_fmt == dst_fmt:
        return
    out = tmp_path / f"out_{src_fmt}_to_{dst_fmt}"
    result = convert(sources[src_fmt], out, to=dst_fmt)  # type: ignore[arg-type]
    assert result.tensors == 10
    _equal(sources[src_fmt], out)
    back = tmp_path / f"back_{src_fmt}_{dst_fmt}"
    convert(out, back, to=src_fmt)  # type: ignore[arg-type]
    _equal(sources[src_fmt], back)


def test_safetensors_output_is_read_by_the_safetensors_library(sources: dict[str, Path]) -> None:
    ref = _state()["model"]
    with safe_open(sources["safetensors"], "pt") as f:
        assert json.loads(f.metadata()["dcpstudio.values"]) == {"step": 3, "meta.name": "run", "meta.lr": 0.5}
        for name, t in ref.items():
            got = f.get_tensor(f"model.{name}")
            assert got.dtype == t.dtype and torch.equal(
                got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
            )


@pytest.mark.filterwarnings("ignore:safetensors holds tensors only")
def test_sharded_output_follows_the_index_convention(sources: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "shards"
    convert(sources["dcp"], out, to="safetensors", max_shard_size="2KB", strip_prefix="model.", include=r"^model\.")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(f.startswith("model-0000") and f"-of-{len(files):05d}" in f for f in files)
    ref = _state()["model"]
    assert set(index["weight_map"]) == set(ref)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ref.values())
    for name, file in index["weight_map"].items():  # transformers-style loading
        with safe_open(out / file, "pt") as f:
            assert torch.equal(
                f.get_tensor(name).reshape(-1).view(torch.uint8), ref[name].reshape(-1).view(torch.uint8)
            )
    for f in files:  # each shard stays within the limit unless one tensor alone exceeds it
        with safe_open(out / f, "pt") as st:
            sizes = [st.get_tensor(k).numel() * st.get_tensor(k).element_size() for k in st.keys()]  # noqa: SIM118
        assert sum(sizes) <= 2000 or len(sizes) == 1
    for entry in (out, out / "model.safetensors.index.json"):  # both are accepted as input
        with open_checkpoint(entry) as ckpt:
            assert set(ckpt.entries) == set(ref)


def test_dtype_cast_touches_floating_tensors_only(sources: dict[str, Path], tmp_path: Path) -> None:
    with pytest.warns(UserWarning):
        convert(sources["torch"], tmp_path / "bf.safetensors", to="safetensors", dtype="bf16")
    ref = _state()["model"]
    with open_checkpoint(tmp_path / "bf.safetensors") as ckpt:
        assert ckpt.entries["model.emb.weight"].dtype == torch.bfloat16
        assert ckpt.entries["model.i32"].dtype == torch.int32 and ckpt.entries["model.mask"].dtype == torch.bool
        assert torch.equal(ckpt.read_tensor("model.emb.weight"), ref["emb.weight"].bfloat16())
        assert torch.equal(ckpt.read_tensor("model.i32"), ref["i32"])


def test_values_that_are_not_json_are_named_in_the_warning(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "c": 1 + 2j, "n": 4}, tmp_path / "a.pt")
    with pytest.warns(UserWarning, match=r"stored 1 value.*left out 1 non-JSON value\(s\): c"):
        convert(tmp_path / "a.pt", tmp_path / "a.safetensors", to="safetensors")


def test_a_value_holding_a_tensor_is_refused_not_left_out(tmp_path: Path) -> None:
    """A tensor inside a value cannot go to safetensors: the conversion refuses, it never drops it
    (issue 26, item 3)."""
    torch.save({"w": torch.ones(2), "pair": (torch.ones(1), 3)}, tmp_path / "a.pt")
    with pytest.raises(DCPStudioError, match=r"'pair' is a tuple value holding 1 tensor"):
        convert(tmp_path / "a.pt", tmp_path / "a.safetensors", to="safetensors")
    assert leftovers(tmp_path) == []


def test_bad_options_and_destinations(sources: dict[str, Path], tmp_path: Path) -> None:
    for bad in ("abc", "0", "-5GB", "5XB"):
        with pytest.raises(ValueError, match="invalid size"):
            convert(sources["torch"], tmp_path / "o", to="safetensors", max_shard_size=bad)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 5 * 10**8
    with pytest.raises(ValueError, match="apply to --to safetensors only"):
        convert(sources["torch"], tmp_path / "o", to="dcp", strip_prefix="model.")
    torch.save({"w": torch.ones(1), "model": {"w": torch.ones(1)}}, tmp_path / "c.pt")
    with pytest.raises(DCPStudioError, match="both become 'w'"):
        convert(tmp_path / "c.pt", tmp_path / "c.safetensors", to="safetensors", strip_prefix="model.")
    with pytest.raises(DCPStudioError, match="does not exist"):
        convert(sources["torch"], tmp_path / "no" / "dir" / "x.safetensors", to="safetensors")
    assert leftovers(tmp_path) == []


@pytest.mark.filterwarnings("ignore:safetensors holds tensors only")
@pytest.mark.parametrize("shard", [None, "1KB"])
def test_cancel_and_failure_leave_nothing(sources: dict[str, Path], tmp_path: Path, shard: str | None) -> None:
    token = CancelToken()

    def progress(p: object) -> None:
        token.cancel()

    out = tmp_path / "cancelled"
    with pytest.raises(CancelledError):
        convert(sources["dcp"], out, to="safetensors", max_shard_size=shard, progress=progress, cancel=token)
    assert not out.exists() and leftovers(tmp_path) == []
    (sources["dcp"] / "__0_0.distcp").write_bytes(b"")  # data gone: the conversion fails midway
    with pytest.raises(DCPStudioError):
        convert(sources["dcp"], out, to="safetensors", max_shard_size=shard)
    assert not out.exists() and leftovers(tmp_path) == []
