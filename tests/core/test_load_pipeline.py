"""The coordinator reads ahead and sends to every rank at once, receivers land bytes straight in
their targets (or read their own regions, when they see the same file): many entries of mixed
dtypes, uneven and empty shards, casts and non-tensor values on 3 ranks still load exactly, and a
failure mid-stream reaches every rank."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from dcpstudio.core.ranks.launch import launch
from tests import _ranks


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pipeline") / "mixed.pt"
    torch.save(_ranks.mixed_state_dict(), path)
    return path


@pytest.mark.parametrize("local_reads", [False, True])
def test_many_mixed_entries_load_exactly_on_three_ranks(mixed: Path, local_reads: bool) -> None:
    results = launch(_ranks.load_mixed, (str(mixed), local_reads), nprocs=3, timeout=180)
    assert [r["wrong"] for r in results] == [[], [], []]
    received = sum(r["received"] for r in results[1:])
    assert results[0]["sent"] == received and (received == 0) == local_reads  # local ranks read for themselves


@pytest.mark.parametrize("at", [0, 7])
def test_a_coordinator_failure_mid_stream_reaches_every_rank(mixed: Path, at: int) -> None:
    t0 = time.monotonic()
    errors = launch(_ranks.coordinator_fails_midway, (str(mixed), at), nprocs=3, timeout=120)
    assert time.monotonic() - t0 < 60  # nobody waited for a timeout
    # each rank raises the coordinator's error: as it reached it, or as dcp.load gathered it
    assert errors[0].startswith("CorruptCheckpointError: cannot read")
    assert all(e.startswith("CorruptCheckpointError: ") and errors[0][24:] in e for e in errors), errors
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("at", [0, 5])
def test_a_receiving_rank_failure_ends_the_load_on_every_rank(mixed: Path, at: int) -> None:
    """A rank whose target rejects its bytes keeps receiving (and dropping) what the coordinator has
    posted for it, so no rank waits for a timeout; every rank raises that rank's error."""
    t0 = time.monotonic()
    errors = launch(_ranks.receiver_fails_midway, (str(mixed), 1, at), nprocs=3, timeout=120)
    assert time.monotonic() - t0 < 60, "a rank waited for the timeout"
    assert all(e.startswith("ValueError: rank 1 refuses") for e in errors), errors
    assert multiprocessing.active_children() == []


def test_a_checkpoint_replaced_during_the_load_is_refused(tmp_path: Path) -> None:
    """Ranks that read for themselves compare their files with those the metadata was built from: a
    file replaced in between is refused on every rank, never read against the old metadata."""
    sd = _ranks.mixed_state_dict(12)
    torch.save(sd, tmp_path / "m.pt")
    torch.save(
        {k: v + 1 if torch.is_tensor(v) and v.is_floating_point() else v for k, v in sd.items()}, tmp_path / "spare.pt"
    )
    errors = launch(
        _ranks.file_replaced_after_metadata, (str(tmp_path / "m.pt"), str(tmp_path / "spare.pt")), nprocs=3, timeout=120
    )
    assert all("changed while it was being loaded" in e for e in errors), errors
