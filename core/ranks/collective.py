"""What every rank of a distributed conversion shares (:mod:`.convert`, :mod:`.upload`): the step
that ends each stage -- every rank's value gathered, or every rank raising the first error any rank
reported -- the one-line form of an error, the fault injection of the tests, and where the ranks
lay the output out (in memory when the machine offers it)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import DCPStudioError

__all__ = ["KILL_VARIABLE", "SCRATCH", "Failed", "agree", "message"]

KILL_VARIABLE = "DCPSTUDIO_TEST_KILL_RANK"  # fault injection: that rank kills itself after its first block
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class Failed(DCPStudioError):
    """A peer's error, raised on every rank after a collective that carried it."""


def agree(error: str | None, value: Any) -> list[Any]:
    """Every rank's ``value``, once no rank reported an ``error`` (else every rank raises it)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (error, value))
    failed = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
    if failed:
        r, e = failed[0]
        raise Failed(e if e.startswith("rank ") else f"rank {r}: {e}")
    return [v for _, v in gathered]


def message(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return text if isinstance(e, DCPStudioError) else f"{type(e).__name__}: {text}"
