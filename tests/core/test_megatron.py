"""Megatron-Core / NeMo ``torch_dist`` checkpoints: a DCP whose ``.metadata`` also holds every rank's
save plan (``Metadata.all_local_plans``), as Megatron's saver sets it (the real producer is in
tests/compat/test_frameworks.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dcpstudio.core import convert, diff, open_checkpoint
from dcpstudio.core.errors import CorruptCheckpointError
from dcpstudio.core.formats.dcp.storage import read_metadata
from dcpstudio.core.ops.report import checkpoint_text
from dcpstudio.core.ranks.load import run_load
from tests.conftest import dcp_save


def megatron_like(out: Path) -> dict[str, Any]:
    """A DCP saved through a planner that keeps the local plans in the metadata, as Megatron's
    ``save_state_dict_async_plan`` does (the plans share their records with the entries)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class KeepPlans(DefaultSavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            plans, md = super().create_global_plan(all_plans)
            md.all_local_plans = all_plans  # type: ignore[attr-defined]
            return plans, md

    g = torch.Generator().manual_seed(1)
    state = {"decoder.weight": torch.randn(6, 4, generator=g), "rng_state/shard_0_1": "state"}
    dcp_save(state, checkpoint_id=str(out), planner=KeepPlans())
    return state


def test_save_plans_in_the_metadata_are_read_as_plain_records(tmp_path: Path) -> None:
    state = megatron_like(tmp_path / "ck")
    with open_checkpoint(tmp_path / "ck") as ckpt:  # refused as "could run code" before
        assert torch.equal(ckpt.read_tensor("decoder.weight"), state["decoder.weight"])
        assert ckpt.read_value("rng_state/shard_0_1") == "state"
    md = read_metadata(tmp_path / "ck")  # what dcp.load is given: torch's planner classes never built
    (item,) = [i for i in md.all_local_plans[0].items if i.tensor_data is not None]
    assert type(item).__module__.startswith("dcpstudio.") and int(item.type) == 1  # TENSOR (Megatron: 2, SHARD)
    convert(tmp_path / "ck", tmp_path / "out.pt")
    with open_checkpoint(tmp_path / "ck") as a, open_checkpoint(tmp_path / "out.pt") as b:
        assert diff(a, b).equal


def test_a_write_item_type_outside_the_enum_is_refused_as_damage(tmp_path: Path) -> None:
    megatron_like(tmp_path / "ck")
    md = tmp_path / "ck" / ".metadata"
    data = md.read_bytes()
    at = data.index(b"WriteItemType")
    end = data.index(b"R", at)  # ... STACK_GLOBAL MEMOIZE BININT1 n TUPLE1 MEMOIZE REDUCE
    assert data[end - 4] == ord("K")
    md.write_bytes(data[: end - 3] + b"\x09" + data[end - 2 :])
    with pytest.raises(CorruptCheckpointError, match="WriteItemType"):
        open_checkpoint(tmp_path / "ck")


def with_sidecars(out: Path) -> dict[str, Any]:
    """``megatron_like`` with Megatron's ``common.pt`` and ``metadata.json`` (as its
    ``TorchCommonSaveStrategy`` and ``save_config`` write them), and a file nobody reads."""
    state = megatron_like(out)
    common = {"iteration": 7, "args": {"lr": 0.5}, "extra": torch.arange(3)}
    torch.save(common, out / "common.pt")
    (out / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (out / "notes.txt").write_text("x")
    return {**state, "common": common}


def test_sidecars_are_entries_carried_into_every_format(tmp_path: Path) -> None:
    with_sidecars(tmp_path / "ck")
    with open_checkpoint(tmp_path / "ck") as ckpt:
        assert ckpt.tree.children["common"].children["args"].children["lr"].entry.value == 0.5
        assert ckpt.entries["metadata.sharded_backend"].value == "torch_dist"
        assert torch.equal(ckpt.read_tensor("common.extra"), torch.arange(3))
        assert ckpt.info["notes"] == ("not carried (files DCP Studio does not read): notes.txt",)
        assert checkpoint_text(ckpt).splitlines()[1] == f"note: {ckpt.info['notes'][0]}"
    for target in ("torch", "dcp", "safetensors"):
        out = tmp_path / f"out_{target}"
        with pytest.warns(UserWarning, match="notes.txt"):
            result = convert(tmp_path / "ck", out, to=target)
        assert any("notes.txt" in n for n in result.notes)
        with open_checkpoint(out) as b:
            assert torch.equal(b.read_tensor("common.extra"), torch.arange(3)), target
            assert b.read_value("common.iteration") == 7 and b.read_value("metadata.sharded_backend_version") == 1
    with open_checkpoint(tmp_path / "ck") as a, open_checkpoint(tmp_path / "out_torch") as b:
        assert diff(a, b).equal and diff(b, a).equal
    reports = run_load(tmp_path / "ck", ranks=2, timeout=240)  # dcp.load was asked for common.* before
    assert all(r.ok and r.checked == 7 for r in reports), [r.mismatches for r in reports]


def test_a_sidecar_that_cannot_be_read_is_named_not_dropped_unsaid(tmp_path: Path) -> None:
    megatron_like(tmp_path / "ck")
    code = b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93."  # a pickle naming os.system
    (tmp_path / "ck" / "common.pt").write_bytes(code)
    with open_checkpoint(tmp_path / "ck") as ckpt:
        assert "decoder.weight" in ckpt.entries and not any(k.startswith("common.") for k in ckpt.entries)
        (note,) = ckpt.info["notes"]
        assert note.startswith("common.pt (Megatron-Core's common state) was not carried:") and "os.system" in note


@pytest.mark.parametrize("changed", [False, True])
def test_a_sharded_object_verifies_the_same_both_ways(tmp_path: Path, changed: bool) -> None:
    """A byte item holding a list of dicts (Megatron's ``rng_state/shard_0_1``) is a subtree of entries
    in torch.save: compared leaf by leaf, with the same answer whichever side is A."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    state = {"w": torch.ones(2), "rng_state/shard_0_1": [{"random": 3, "t": torch.arange(4)}]}
    dcp_save(state, checkpoint_id=str(tmp_path / "ck"), planner=DefaultSavePlanner(flatten_state_dict=False))
    if changed:
        state["rng_state/shard_0_1"][0]["t"] = torch.arange(1, 5)  # type: ignore[index]
    torch.save(state, tmp_path / "b.pt")
    with open_checkpoint(tmp_path / "ck") as a, open_checkpoint(tmp_path / "b.pt") as b:
        assert a.entries["rng_state/shard_0_1"].kind == "bytes" and "rng_state/shard_0_1.0.t" in b.entries
        ab, ba = diff(a, b), diff(b, a)
    assert ab.equal == ba.equal == (not changed)
    assert ab.objects == ba.objects == (["rng_state/shard_0_1"] if changed else [])
    assert not (ab.only_a or ab.only_b or ba.only_a or ba.only_b)


def test_a_sidecar_whose_names_are_taken_or_not_json_is_named_not_merged(tmp_path: Path) -> None:
    dcp_save({"common.iteration": torch.ones(1)}, checkpoint_id=str(tmp_path / "ck"))
    torch.save({"iteration": 7}, tmp_path / "ck" / "common.pt")
    (tmp_path / "ck" / "metadata.json").write_text("[1, 2]")
    with open_checkpoint(tmp_path / "ck") as ckpt:
        assert ckpt.entries["common.iteration"].kind == "tensor" and len(ckpt.entries) == 1
        assert ckpt.info["notes"] == (
            "common.pt (Megatron-Core's common state) was not carried: its name 'common.iteration' is taken",
            "metadata.json (Megatron-Core's checkpoint config) was not carried: holds a list, not an object",
        )


def test_no_payload_in_a_sidecar_runs(tmp_path: Path) -> None:
    """A hostile ``common.pt`` / ``meta.pt`` (tests/reliability/test_hostile.py's payloads): refused by
    the restricted unpickler, named in a note; the DCP itself opens, converts and verifies."""
    from tests.reliability.test_hostile import _payloads, _torch_with_pickle

    marker = tmp_path / "PAYLOAD_RAN"
    for k, (name, pkl) in enumerate(_payloads(marker).items()):
        src = tmp_path / f"ck-{name}"
        dcp_save({"w": torch.ones(3)}, checkpoint_id=str(src))
        sidecar = ("common.pt", "meta.pt")[k % 2]
        _torch_with_pickle(src / sidecar, pkl)
        convert(src, tmp_path / f"{name}.pt")
        with open_checkpoint(src) as a, open_checkpoint(tmp_path / f"{name}.pt") as b:
            assert list(a.entries) == ["w"] and diff(a, b).equal
            (note,) = a.info["notes"]
            assert note.startswith(f"{sidecar} (") and "was not carried" in note, note
        assert not marker.exists(), f"{name} in {sidecar} ran"
