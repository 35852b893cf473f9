"""A source checkpoint seen through a mapping's :class:`~.plan.Plan`: a :class:`Checkpoint` whose
entries are the plan's outputs, each computed from its sources when it is read.

Because it is a checkpoint, the existing machinery serves it unchanged: :func:`~..ops.convert.convert.convert`
streams it to any format (an output that is a plain rename is the source's own tensor reference,
so its bytes are copied in the kernel; a computed one is a lazy reference whose bytes are made
when the writer reaches it), and :func:`~..ops.compare.diff.diff` compares it with a written
destination block by block -- verification recomputes every destination tensor from the source.

The outputs of one chain (the experts one grouped tensor unstacks into, the q/k/v a fused weight
splits into) are computed together and kept until the next chains push them out (:data:`KEPT`):
memory stays bounded by a chain's sources and outputs, never the model.

Computing holds torch to one intra-op thread (:func:`~..compare.values.one_torch_thread`) from the
first computed output until :meth:`Mapped.close`: each operation moves a tensor's bytes once, too
little to gain from a thread team, and on a busy machine every op waited for the team's second
thread to be scheduled (measured: a 512 KiB permute took 8 ms instead of 0.05 ms on 2 loaded cores).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ...checkpoints import Checkpoint, Region
from ...checkpoints.model import Chunk, Entry
from ...errors import CorruptCheckpointError
from ...io.raw import FileRange, pread_into
from ...pickles.refs import StorageRef, TensorRef
from ...pickles.tensor_io import tensor_bytes, to_bytes
from ..compare.values import one_torch_thread
from .plan import Output, Plan
from .tensor_ops import apply_ops, row_order

if TYPE_CHECKING:
    import torch

__all__ = ["KEPT", "Mapped"]

KEPT = 2
"""Chains whose outputs are kept: the one being written and the one the writer prefetches."""


class Mapped(Checkpoint):
    """``source`` through ``plan``. The source stays the caller's to close."""

    def __init__(self, source: Checkpoint, plan: Plan) -> None:
        self.source = source
        self.plan = plan
        self.outputs = {o.name: o for o in plan.outputs}
        entries = {}
        for o in plan.outputs:
            if o.value:
                entries[o.name] = source.entries[o.sources[0]]
            else:
                entries[o.name] = Entry(o.name, "tensor", o.dtype, o.shape)
        super().__init__(source.path, entries, source.info)
        self.format = source.format
        self.label = source.label
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[Any, ...], list[torch.Tensor]] = OrderedDict()
        self._held = contextlib.ExitStack()  # one torch thread, once something is computed
        self._holding = False

    def _output(self, fqn: str) -> Output:
        self.entry(fqn)
        return self.outputs[fqn]

    def tensor_ref(self, fqn: str) -> TensorRef:
        o = self._output(fqn)
        if o.identity:
            return self.source.tensor_ref(o.sources[0])
        return super().tensor_ref(fqn)

    def chunks(self, fqn: str) -> list[Chunk]:
        return [c for s in self._output(fqn).sources for c in self.source.chunks(s)]

    def read_object(self, fqn: str, limit: int | None = None) -> Any:
        return self.source.read_object(self._output(fqn).sources[0], limit)

    def _computed(self, o: Output) -> torch.Tensor:
        with self._lock:
            made = self._kept.get(o.key)
            if made is None:
                if not self._holding:
                    self._held.enter_context(one_torch_thread())
                    self._holding = True
                made = apply_ops([self.source.read_tensor(s) for s in o.sources], o.ops)
                self._kept[o.key] = made
                while len(self._kept) > KEPT:
                    self._kept.popitem(last=False)
            else:
                self._kept.move_to_end(o.key)
            return made[o.index]

    def read_tensor(self, fqn: str, region: Region | None = None) -> torch.Tensor:
        o = self._output(fqn)
        if o.identity:
            return self.source.read_tensor(o.sources[0], region)
        t = self._computed(o)
        return t[tuple(region)] if region else t

    def storage_bytes(self, ref: StorageRef) -> memoryview:
        """A written output's bytes: an output that only reorders its source's rows (the rotary
        permute) is gathered from the source's bytes, read once, without torch; the rest are
        computed (:meth:`read_tensor`)."""
        o = self._output(ref.key)
        order = None if o.identity or len(o.sources) != 1 or len(o.shape) != 2 else row_order(o.ops, o.shape[0])
        if order is None:
            return to_bytes(self.read_tensor(ref.key))
        return _gather_rows(self._source_bytes(o.sources[0]), order)

    def _source_bytes(self, fqn: str) -> memoryview:
        data = tensor_bytes(self.source.tensor_ref(fqn), need_crc=False)
        if not isinstance(data, FileRange):
            return data[0]
        view = memoryview(bytearray(data.nbytes))
        if pread_into(data.fd, view, data.start()) < data.nbytes:
            raise CorruptCheckpointError(f"{self.source.label}: {fqn} ends early (truncated?)")
        return view

    def close(self) -> None:
        """The source is the caller's; what is kept is released, torch's threads given back."""
        self._kept.clear()
        self._held.close()
        self._holding = False


def _gather_rows(raw: memoryview, order: list[int]) -> memoryview:
    """The rows of ``raw`` (a row-major 2-D tensor's bytes, ``len(order)`` rows) in ``order``."""
    size = len(raw) // len(order) if order else 0
    out = memoryview(bytearray(len(raw)))
    for at, r in enumerate(order):
        out[at * size : (at + 1) * size] = raw[r * size : (r + 1) * size]
    return out
