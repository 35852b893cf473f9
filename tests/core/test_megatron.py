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
from dcpstudio.core.formats.dcp_storage import read_metadata
from tests.conftest import dcp_save


def megatron_like(out: Path) -> dict[str, Any]:
    """A DCP saved through a planner that keeps the local plans in the metadata, as Megatron's
    ``save_state_dict_async_plan`` does (the plans share their records with the entries)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class KeepPlans(DefaultSavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            plans, md = super().create_global_plan(all_plans)
            md.all_local_plans = all_plans
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
