"""What each subcommand of ``dcpstudio`` does, and the terminal progress bar they share.

Each takes the parsed arguments, calls ``dcpstudio.core``, prints its result and returns the exit
code; errors propagate to :func:`dcpstudio.cli.main.main`, which prints them on one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from .distributed import distributed_requested, run_distributed_convert
from .flags import check_load_flags, convert_options, resolve_target
from .mapping_commands import check_mapping_flags, run_map_convert, run_map_verify, run_mappings

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_CANCELLED = 0, 1, 2, 130


class TerminalProgress:
    """A one-line progress bar on a terminal (nothing when the stream is not a TTY)."""

    def __init__(self, stream: TextIO = sys.stderr, interval: float = 0.1) -> None:
        self._stream = stream
        self._enabled = stream.isatty()
        self._interval = interval
        self._last = 0.0
        self._start = time.monotonic()
        from dcpstudio.core.ops.report import human_bytes

        self._human = human_bytes

    def __call__(self, p: Any) -> None:
        now = time.monotonic()
        if not self._enabled or (now - self._last < self._interval and p.fraction < 1.0):
            return
        self._last = now
        width = 30
        filled = int(width * p.fraction)
        rate = p.done_bytes / max(now - self._start, 1e-6)
        line = (
            f"\r[{'#' * filled}{'.' * (width - filled)}] {p.fraction * 100:5.1f}% "
            f"{self._human(p.done_bytes)}/{self._human(p.total_bytes)} {self._human(rate)}/s {p.current[-40:]:<40}"
        )
        self._stream.write(line)
        self._stream.flush()

    def close(self) -> None:
        if self._enabled and self._last:
            self._stream.write("\n")
            self._stream.flush()


def _mapped(args: argparse.Namespace, run: Callable[[argparse.Namespace, Any], int], show: bool) -> int:
    bar = TerminalProgress() if show else None
    try:
        return run(args, bar)
    finally:
        if bar is not None:
            bar.close()


def _run_convert(args: argparse.Namespace) -> int:
    from dcpstudio.core import convert, dcp_to_torch_save, torch_save_to_dcp
    from dcpstudio.core.ops.report import human_bytes, plural

    mapping = check_mapping_flags(args)
    if distributed_requested(args):
        named = getattr(args, "named", None)
        to = resolve_target(args.dst, args.to, named, args.max_shard_size is not None) if not mapping else args.to
        return run_distributed_convert(args, mapping, to)
    if mapping:
        return _mapped(args, run_map_convert, not (args.quiet or args.dry_run))
    bar = TerminalProgress() if not args.quiet else None
    start = time.monotonic()
    named = getattr(args, "named", None)
    options = convert_options(args, named=named is not None)
    to = resolve_target(args.dst, getattr(args, "to", None), named, getattr(args, "max_shard_size", None) is not None)
    try:
        if named is not None:  # format_utils' names: the source format is part of the command
            named_fn = torch_save_to_dcp if named == "torch_to_dcp" else dcp_to_torch_save
            result = named_fn(args.src, args.dst, progress=bar, **options)
        else:
            result = convert(args.src, args.dst, to=to, progress=bar, **options)
    finally:
        if bar is not None:
            bar.close()
    if not args.quiet:
        seconds = time.monotonic() - start
        print(
            f"wrote {result.dst} ({result.target}): {plural(result.tensors, 'tensor')}, "
            f"{plural(result.values, 'other value')}, "
            f"{human_bytes(result.tensor_bytes)} in {seconds:.2f} s"
        )
    return EXIT_OK


def _run_inspect(args: argparse.Namespace) -> int:
    import json

    from dcpstudio.core import open_checkpoint
    from dcpstudio.core.ops.report import checkpoint_json, checkpoint_text

    with open_checkpoint(args.path, trust_pickle=args.trust_pickle) as ckpt:
        if args.json:
            json.dump(checkpoint_json(ckpt, resolve_chunks=args.chunks), sys.stdout)
            sys.stdout.write("\n")
        else:
            print(checkpoint_text(ckpt, chunks=args.chunks))
    return EXIT_OK


def _run_verify(args: argparse.Namespace) -> int:
    import json

    from dcpstudio.core.ops.convert.transform import Transform
    from dcpstudio.core.ops.report import LIST_LIMIT
    from dcpstudio.core.ops.verify import verify

    if check_mapping_flags(args):
        return _mapped(args, run_map_verify, not (args.quiet or args.json))
    transform = Transform(args.include, args.exclude, args.dtype, args.strip_prefix)
    bar = TerminalProgress() if not (args.quiet or args.json) else None
    try:
        result = verify(
            args.a,
            args.b,
            transform,
            rtol=args.rtol,
            atol=args.atol,
            quick=args.quick,
            trust_pickle=args.trust_pickle,
            allow_empty=args.allow_empty,
            progress=bar,
        )
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps(result.json()))
    else:
        print(result.text(limit=None if args.all else LIST_LIMIT))
    return EXIT_OK if result.equal else EXIT_ERROR


def _run_compare(args: argparse.Namespace) -> int:
    """The window's compare table on the terminal: the same :func:`dcpstudio.core.ops.compare.diff.compare`."""
    import json

    from dcpstudio.core import open_checkpoint
    from dcpstudio.core.ops.compare.diff import compare
    from dcpstudio.core.ops.report import compare_csv, compare_json, compare_text

    bar = TerminalProgress() if not (args.quiet or args.json or args.csv) else None
    try:
        with (
            open_checkpoint(args.a, trust_pickle=args.trust_pickle) as a,
            open_checkpoint(args.b, trust_pickle=args.trust_pickle) as b,
        ):
            rows = compare(a, b, rtol=args.rtol, atol=args.atol, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    equal = all(r.status == "equal" for r in rows)
    shown = [r for r in rows if not (args.differences_only and r.status == "equal")]
    if args.json:
        print(json.dumps(compare_json(str(args.a), str(args.b), shown, args.rtol, args.atol, equal)))
    elif args.csv:
        print(compare_csv(shown))
    else:
        print(compare_text(rows, differences_only=args.differences_only))
    return EXIT_OK if equal else EXIT_ERROR


def _load_table(reports: list[Any], as_json: bool) -> int:
    import json
    from dataclasses import asdict

    from dcpstudio.core.ops.report import human_bytes, plural

    if as_json:
        print(json.dumps([{**asdict(r), "ok": r.ok} for r in reports]))
    else:
        print(
            f"{'rank':>4} {'load time':>10} {'start-up':>9} {'received':>11} {'sent':>11} {'local':>11} "
            f"{'peak RSS':>10}  check"
        )
        for r in reports:
            check = f"ok ({plural(r.checked, 'entry')})" if r.ok else f"MISMATCH: {', '.join(r.mismatches[:5])}"
            print(
                f"{r.rank:>4} {r.seconds:>9.2f}s {r.startup:>8.2f}s {human_bytes(r.bytes_received):>11} "
                f"{human_bytes(r.bytes_sent):>11} "
                f"{human_bytes(r.local_bytes):>11} {human_bytes(r.peak_rss):>10}  {check}"
            )
    return EXIT_OK if all(r.ok for r in reports) else EXIT_ERROR


def _run_load(args: argparse.Namespace) -> int:
    from dcpstudio.core.ranks.load import load_rank, parse_mesh, run_load

    if args.ranks is None and "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        import torch.distributed as dist

        check_load_flags(int(os.environ["WORLD_SIZE"]), args.mesh, world="torchrun's WORLD_SIZE is")
        dist.init_process_group("nccl" if _cuda_per_rank() else "gloo")
        try:
            world, rank = dist.get_world_size(), dist.get_rank()
            report = load_rank(
                rank,
                world,
                lambda stage, f: None,
                args.path,
                args.layout,
                parse_mesh(args.mesh, world),
                args.trust_pickle,
                not args.stream,
            )
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object(report, gathered, dst=0)
        finally:
            dist.destroy_process_group()
        code = _load_table(gathered, args.json) if gathered is not None else (EXIT_OK if report.ok else EXIT_ERROR)
        # the rank ends here, as torch.multiprocessing's do: without the interpreter's teardown, in which
        # a torchrun rank aborted ("terminate called without an active exception") ~1 run in 20
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    mesh_size = check_load_flags(args.ranks, args.mesh)
    reports = run_load(
        args.path,
        ranks=args.ranks if args.ranks is not None else (mesh_size or 2),
        layout=args.layout,
        mesh=args.mesh,
        timeout=args.timeout,
        trust_pickle=args.trust_pickle,
        local_reads=not args.stream,
    )
    return _load_table(reports, args.json)


def _cuda_per_rank() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _run_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dcpstudio.core import dcp_to_torch_save
    from dcpstudio.core.ops.demo import write_demo

    pt, dcp_dir = write_demo(Path(args.dir) if args.dir else None)
    back = pt.with_name("demo_roundtrip.pt")
    dcp_to_torch_save(dcp_dir, back, overwrite=True)
    import torch

    a = torch.load(pt, weights_only=True)
    b = torch.load(back, weights_only=True)
    same = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and a["step"] == b["step"]
    print(f"demo torch.save file: {pt}")
    print(f"demo DCP checkpoint:  {dcp_dir}")
    print(f"round trip through DCP: {back} ({'identical' if same else 'DIFFERENT'})")
    return EXIT_OK if same else EXIT_ERROR


def _run_export(args: argparse.Namespace) -> int:
    from dcpstudio.core import export_tensor, open_checkpoint
    from dcpstudio.core.ops.report import human_bytes

    bar = TerminalProgress() if not args.quiet else None
    start = time.monotonic()
    try:
        with open_checkpoint(args.path, trust_pickle=args.trust_pickle) as ckpt:
            result = export_tensor(ckpt, args.name, args.dst, fmt=args.format, overwrite=args.overwrite, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    if not args.quiet:
        seconds = time.monotonic() - start
        print(f"wrote {result.dst} ({result.fmt}, {result.dtype}): {human_bytes(result.nbytes)} in {seconds:.2f} s")
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "convert": _run_convert,
    "torch_to_dcp": _run_convert,
    "torch-to-dcp": _run_convert,
    "dcp_to_torch": _run_convert,
    "dcp-to-torch": _run_convert,
    "inspect": _run_inspect,
    "load": _run_load,
    "verify": _run_verify,
    "compare": _run_compare,
    "export": _run_export,
    "demo": _run_demo,
    "mappings": run_mappings,
}
