"""Verify a conversion's output against its source *through* the transform it was written with.

A filtered, cast or renamed output differs from its whole source by design; comparing the two
reports every excluded entry as "only in A" and every cast tensor as different, which hides a
real difference among them. :func:`verify` compares the output with the source as the conversion
saw it (:class:`~.convert.transform.Transformed`): the entries it kept, under their new names, cast with
torch's own ``Tensor.to`` -- so a cast output is checked exactly, not within a tolerance that
would also let a wrong value through. The CLI's ``verify`` and the window's Verify call it.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from ..checkpoints.opening import open_checkpoint
from ..progress import CancelToken, ProgressCallback, Reporter
from ..units import exact_count
from .compare.bitwise import bitwise_equal
from .compare.diff import PAIR_BUDGET, DiffReport, diff
from .convert.transform import Transform, Transformed
from .report import diff_json, diff_text

__all__ = ["Verification", "verify"]

_BITWISE_BUDGET = 16 << 20  # bytes per block of each side when comparing bit for bit (no float64 copies)
_NAMES = {"dcp": "a DCP checkpoint", "torch": "a torch.save file", "safetensors": "a safetensors checkpoint"}


@dataclass(frozen=True)
class Verification:
    """A :class:`~.compare.diff.DiffReport` of the source seen through ``transform`` (A) against the
    output (B); ``kept`` of the source's ``entries`` went through."""

    report: DiffReport
    transform: Transform
    kept: int
    entries: int

    @property
    def equal(self) -> bool:
        return self.report.equal

    def through(self) -> str:
        """The line that says what A is, empty when it is the whole source as stored."""
        if self.transform.identity:
            return ""
        kept, entries = exact_count(self.kept), exact_count(self.entries)
        return f"A is the source through {self.transform.flags()}: {kept} of {entries} entries"

    def text(self, limit: int | None = None) -> str:
        """:func:`~.report.diff_text`'s summary first, then what A is, then each difference."""
        first, *rest = diff_text(self.report, limit).split("\n")
        return "\n".join([first, *([self.through()] if self.through() else []), *rest])

    def json(self) -> dict[str, object]:
        """:func:`~.report.diff_json`, plus ``"transform"`` (the options; null where not given),
        ``"kept"`` and ``"source_entries"``."""
        return {**diff_json(self.report), "transform": asdict(self.transform), "kept": self.kept,
                "source_entries": self.entries}  # fmt: skip


def verify(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    transform: Transform | None = None,
    *,
    rtol: float = 0.0,
    atol: float = 0.0,
    quick: bool = False,
    trust_pickle: bool = False,
    allow_empty: bool = False,
    budget: int = PAIR_BUDGET,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
) -> Verification:
    """Compare ``out`` with ``src`` seen through ``transform`` (:func:`~.compare.diff.diff`'s rules and
    tolerances); checkpoints that are bitwise equal are found so without torch first
    (:func:`~.compare.bitwise.bitwise_equal`: the same report, sooner). A transform that cannot
    have made ``out`` is refused (``ValueError``): a ``strip_prefix`` for an output that is not
    safetensors (only that target renames), a prefix that starts no kept name; a selection that
    keeps nothing is refused as conversion refuses it."""
    transform = transform or Transform()
    with open_checkpoint(src, trust_pickle=trust_pickle) as a, open_checkpoint(out, trust_pickle=trust_pickle) as b:
        p = transform.strip_prefix
        if p is not None and b.format != "safetensors":
            raise ValueError(f"--strip-prefix applies to safetensors outputs only; {out} is {_NAMES[b.format]}")
        seen = Transformed(a, transform, allow_empty=allow_empty)
        if p is not None and seen.entries and not any(transform.keep(f) and f.startswith(p) for f in a.entries):
            raise ValueError(f"--strip-prefix {p!r} starts no entry of {src}; names look like {next(iter(a.entries))}")
        report = None
        if transform.identity and set(a.entries) == set(b.entries):  # bitwise equal: known without torch
            reporter = Reporter(
                progress, cancel, total_bytes=a.tensor_bytes + b.tensor_bytes, total_items=len(a.entries)
            )
            if bitwise_equal(a, b, budget=max(budget, _BITWISE_BUDGET), reporter=reporter):
                report = DiffReport(str(seen.path), str(b.path), compared=len(a.entries))
        if report is None:
            report = diff(seen, b, rtol=rtol, atol=atol, budget=budget, progress=progress, cancel=cancel, quick=quick)
        return Verification(report, transform, len(seen.entries), len(a.entries))
