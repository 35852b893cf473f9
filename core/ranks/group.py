"""The one collective a distributed conversion needs -- every rank's value, on every rank -- over
torch's process group (torchrun), or over pipes between local ranks (``--ranks N``).

Local ranks need no torch: a conversion that does not compute with it (copies, a float32 ->
bfloat16 cast) then starts its ranks in a fraction of a second instead of importing torch and
joining a gloo group (1.3-2 s here, paid before any byte is converted). Rank 0 is the hub: each
rank sends it its value and receives the list back. A rank that dies closes its pipe, so its peers'
next collective raises, as gloo's does when a peer's connection breaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..errors import DCPStudioError

__all__ = ["Group", "GroupError", "PipeGroup", "TorchGroup"]


class GroupError(DCPStudioError):
    """A peer left the group (it died, or was stopped)."""


class Group(Protocol):
    rank: int
    world: int

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order; every rank calls it, in the same order."""
        ...


class TorchGroup:
    """torch.distributed's default process group (initialised by the caller)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def all_gather(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, value)
        return gathered


class PipeGroup:
    """Local ranks linked by pipes to rank 0: ``links`` are rank 0's connections to ranks 1..N-1,
    or another rank's one connection to rank 0."""

    def __init__(self, rank: int, world: int, links: Sequence[Any]) -> None:
        self.rank, self.world = rank, world
        self._links = list(links)

    def _recv(self, conn: Any, peer: int) -> Any:
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            raise GroupError(f"rank {peer} left the conversion (died or stopped)") from e

    def _send(self, conn: Any, value: Any, peer: int) -> None:
        try:
            conn.send(value)
        except OSError as e:
            raise GroupError(f"rank {peer} left the conversion (died or stopped)") from e

    def all_gather(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        if self.rank:
            self._send(self._links[0], value, 0)
            gathered: list[Any] = self._recv(self._links[0], 0)
            return gathered
        values = [value, *(self._recv(c, r) for r, c in enumerate(self._links, 1))]
        for r, c in enumerate(self._links, 1):
            self._send(c, values, r)
        return values

    def close(self) -> None:
        for c in self._links:
            c.close()
