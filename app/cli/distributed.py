"""``convert`` on many ranks: ``--ranks N`` starts N local ranks, and under ``torchrun`` every
process is one rank (see :mod:`dcpstudio.core.ranks.convert`). Progress is drawn per rank: from the
ranks' reports with ``--ranks``, and under torchrun by rank 0 from what each rank posts in the
process group's store."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, TextIO

from .flags import RESHARD_FLAGS, UsageError, convert_options

__all__ = ["RanksProgress", "distributed_requested", "run_distributed_convert"]


def distributed_requested(args: argparse.Namespace) -> bool:
    """``--ranks``, or a torchrun rank (``WORLD_SIZE`` and ``RANK`` set, no ``--ranks``)."""
    ranks = getattr(args, "ranks", None)
    torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if getattr(args, "named", None) is not None:
        if torchrun:  # every rank would write the same output on its own
            raise UsageError(f"{args.named} runs on one process; under torchrun use `convert SRC DST --to ...`")
        return False
    if ranks is not None and ranks < 1:
        raise UsageError(f"--ranks {ranks}: needs at least 1 rank")
    if getattr(args, "dry_run", False):
        if ranks is not None:
            raise UsageError("--dry-run writes nothing: the plan is the same on any number of ranks; drop --ranks")
        return False
    return ranks is not None or torchrun


class RanksProgress:
    """One line, each rank's share done (``rank 0 45% | rank 1 52%``), on a terminal only."""

    def __init__(self, world: int, stream: TextIO = sys.stderr, interval: float = 0.2) -> None:
        self.fractions = [0.0] * world
        self._stream = stream
        self._enabled = stream.isatty()
        self._interval = interval
        self._last = 0.0

    def update(self, rank: int, fraction: float) -> None:
        self.fractions[rank] = fraction
        now = time.monotonic()
        if not self._enabled or (now - self._last < self._interval and min(self.fractions) < 1.0):
            return
        self._last = now
        line = " | ".join(f"rank {r} {f * 100:5.1f}%" for r, f in enumerate(self.fractions))
        self._stream.write(f"\r{line[:160]}")
        self._stream.flush()

    def close(self) -> None:
        if self._enabled and self._last:
            self._stream.write("\n")
            self._stream.flush()


def _options(args: argparse.Namespace, mapping: bool, to: str | None) -> dict[str, Any]:
    if any(getattr(args, name, None) for name in RESHARD_FLAGS):
        raise UsageError("--for-ranks (resharding) runs on one process: drop --ranks, or run it outside torchrun")
    if mapping:
        return dict(convert_options(args, mapping=True), mapping=args.mapping, config=args.config, to=args.to)
    options = convert_options(args)
    for name in RESHARD_FLAGS:  # refused above: none given
        del options[name]
    return dict(options, to=to)


def _summary(result: Any, shares: list[Any], seconds: float) -> None:
    from dcpstudio.core.ops.report import human_bytes, plural

    print(
        f"wrote {result.dst} ({result.target}): {plural(result.tensors, 'tensor')}, "
        f"{plural(result.values, 'other value')}, {human_bytes(result.tensor_bytes)} in {seconds:.2f} s "
        f"on {plural(len(shares), 'rank')}"
    )
    mean = sum(s.nbytes for s in shares) / max(1, len(shares))
    for s in shares:
        off = f"{(s.nbytes - mean) / mean * 100:+.1f}% of the mean" if mean else "-"
        print(f"  rank {s.rank}: {human_bytes(s.nbytes)} ({off}) in {plural(s.pieces, 'piece')}, {s.seconds:.2f} s")


def run_distributed_convert(args: argparse.Namespace, mapping: bool, to: str | None) -> int:
    options = _options(args, mapping, to)
    start = time.monotonic()
    if args.ranks is not None:
        from dcpstudio.core.ranks.launch import LIGHT_PRELOAD, can_fork_parent, prestart

        # one launch in this process: its ranks are forks of it (milliseconds: it has imported and
        # planned), or -- where it cannot be forked -- come from a fork server started first, to
        # import beside this process; they import torch only if they need it
        light = getattr(args, "process_is_command", False)
        if light and not can_fork_parent():
            prestart((*LIGHT_PRELOAD, "dcpstudio.core.ranks.convert"))
        from dcpstudio.core.ranks.convert import run_convert

        bar = RanksProgress(args.ranks) if not args.quiet else None
        try:
            result, shares = run_convert(
                args.src,
                args.dst,
                ranks=args.ranks,
                timeout=args.timeout,
                preload=LIGHT_PRELOAD if light else None,
                fork_parent=light,
                on_progress=(lambda p: bar.update(p.rank, p.fraction)) if bar is not None else None,
                **options,
            )
        finally:
            if bar is not None:
                bar.close()
        if not args.quiet:
            _summary(result, shares, time.monotonic() - start)
        return 0
    return _under_torchrun(args, options, start)


def _under_torchrun(args: argparse.Namespace, options: dict[str, Any], start: float) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    from dcpstudio.core.ranks.convert import convert_on_ranks

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        store = dist.distributed_c10d._get_default_store()
        store.set(f"dcpstudio/progress/{rank}", "0")
        bar = RanksProgress(world) if rank == 0 and not args.quiet else None
        last = [0.0]

        def progress(p: Any) -> None:
            now = time.monotonic()
            if now - last[0] < 0.2 and p.fraction < 1.0:
                return
            last[0] = now
            store.set(f"dcpstudio/progress/{rank}", f"{p.fraction:.4f}")
            if bar is not None:
                for r in range(world):
                    bar.update(r, float(store.get(f"dcpstudio/progress/{r}").decode()))

        try:
            result, share = convert_on_ranks(args.src, args.dst, options, progress=progress)
        finally:
            if bar is not None:
                bar.close()
        shares: list[Any] = [None] * world
        dist.all_gather_object(shares, share)
    finally:
        dist.destroy_process_group()
    if rank == 0 and not args.quiet:
        _summary(result, shares, time.monotonic() - start)
    # the rank ends here, without the interpreter's teardown (as `load` under torchrun: a torchrun rank
    # aborted in it now and then)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
