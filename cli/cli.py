"""The ``dcpstudio`` command: no arguments opens the window (``--demo``: on a generated demo
checkpoint); subcommands serve scripts and CI.

Every subcommand calls the same ``dcpstudio.core`` functions as the window. Failures print one
line (``dcpstudio: error: ...``) and exit non-zero; set ``DCPSTUDIO_DEBUG=1`` for a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TextIO

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_CANCELLED = 0, 1, 2, 130


class TerminalProgress:
    """A one-line progress bar on a terminal (nothing when the stream is not a TTY)."""

    def __init__(self, stream: TextIO = sys.stderr, interval: float = 0.1) -> None:
        self._stream = stream
        self._enabled = stream.isatty()
        self._interval = interval
        self._last = 0.0
        self._start = time.monotonic()
        from dcpstudio.core.report import human_bytes

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


def _add_convert_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source checkpoint (DCP directory, torch.save file or safetensors)")
    p.add_argument("dst", help="destination path")
    p.add_argument("--include", metavar="RE", help="keep only entries whose name matches RE (re.search)")
    p.add_argument("--exclude", metavar="RE", help="drop entries whose name matches RE (re.search)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="unpickle without restrictions (runs code embedded in the checkpoint; only for files you trust)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcpstudio",
        description="Convert, inspect and load PyTorch checkpoints: DCP directories, torch.save files, safetensors.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"dcpstudio {__version__}")
    parser.add_argument(
        "--demo",
        action="store_true",
        help="write a demo DCP checkpoint and torch.save file, and open the window on them",
    )
    parser.add_argument(
        "--quit-after", type=float, metavar="SECONDS", help="close the window after SECONDS (smoke tests)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("convert", help="convert a checkpoint (target inferred from the source)")
    _add_convert_options(p)
    p.add_argument(
        "--to",
        choices=["dcp", "torch", "safetensors"],
        help="target format (default: DCP <-> torch.save; safetensors -> DCP)",
    )
    p.add_argument("--max-shard-size", metavar="SIZE", help="safetensors: shards of at most SIZE (5GB, 500MiB) + index")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating-point tensors")
    p.add_argument("--strip-prefix", metavar="PREFIX", help="safetensors: drop PREFIX from names (e.g. 'model.')")
    p.add_argument("--files", type=int, metavar="N", help="DCP: spread the data over N files")
    p.add_argument("--max-file-size", metavar="SIZE", help="DCP: data files of at most SIZE (5GB, 500MiB)")
    for name, text in (
        ("torch_to_dcp", "torch.save file -> DCP directory (format_utils' argument order)"),
        ("dcp_to_torch", "DCP directory -> torch.save file (format_utils' argument order)"),
    ):
        p = sub.add_parser(name, help=text, aliases=[name.replace("_", "-")])
        _add_convert_options(p)
        p.set_defaults(named=name)

    p = sub.add_parser("inspect", help="show what a checkpoint holds, without loading its tensors")
    p.add_argument("path", help="DCP directory, torch.save file or safetensors file/directory")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema in dcpstudio.core.report)")
    p.add_argument("--chunks", action="store_true", help="list each tensor's chunks with their files and bytes")
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")

    p = sub.add_parser("verify", help="compare two checkpoints of any formats (exit 0 equal, 1 different, 2 error)")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exact)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "load",
        help="load a checkpoint on N ranks in a layout and check every shard (also under torchrun)",
    )
    p.add_argument("path", help="any checkpoint: DCP directory, torch.save file(s), safetensors")
    p.add_argument("--ranks", type=int, help="local ranks to spawn (omit under torchrun)")
    p.add_argument("--layout", default="shard0", choices=["replicate", "shard0", "shard1", "fsdp"])
    p.add_argument("--mesh", help="device mesh shape, e.g. 2x2 (default: 1-D over all ranks)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are stopped")
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")
    p.add_argument("--json", action="store_true", help="per-rank reports as JSON")

    p = sub.add_parser("open", help="open the window on a checkpoint")
    p.add_argument("path")

    p = sub.add_parser("demo", help="write a demo torch.save file and DCP checkpoint, convert and check them")
    p.add_argument("--dir", help="where to write (default: the user data directory)")
    return parser


def _run_convert(args: argparse.Namespace) -> int:
    from dcpstudio.core import convert, dcp_to_torch_save, torch_save_to_dcp
    from dcpstudio.core.report import human_bytes

    bar = TerminalProgress() if not args.quiet else None
    start = time.monotonic()
    options: dict[str, Any] = dict(
        progress=bar,
        include=args.include,
        exclude=args.exclude,
        overwrite=args.overwrite,
        trust_pickle=args.trust_pickle,
    )
    try:
        named = getattr(args, "named", None)
        if named is not None:  # format_utils' names: the source format is part of the command
            named_fn = torch_save_to_dcp if named == "torch_to_dcp" else dcp_to_torch_save
            result = named_fn(args.src, args.dst, **options)
        else:
            result = convert(
                args.src,
                args.dst,
                to=args.to,
                max_shard_size=args.max_shard_size,
                dtype=args.dtype,
                strip_prefix=args.strip_prefix,
                files=args.files,
                max_file_size=args.max_file_size,
                **options,
            )
    finally:
        if bar is not None:
            bar.close()
    if not args.quiet:
        seconds = time.monotonic() - start
        print(
            f"wrote {result.dst} ({result.target}): {result.tensors} tensors, {result.values} other values, "
            f"{human_bytes(result.tensor_bytes)} in {seconds:.2f} s"
        )
    return EXIT_OK


def _run_inspect(args: argparse.Namespace) -> int:
    import json

    from dcpstudio.core import open_checkpoint
    from dcpstudio.core.report import checkpoint_json, checkpoint_text

    with open_checkpoint(args.path, trust_pickle=args.trust_pickle) as ckpt:
        if args.json:
            json.dump(checkpoint_json(ckpt, resolve_chunks=args.chunks), sys.stdout)
            sys.stdout.write("\n")
        else:
            print(checkpoint_text(ckpt, chunks=args.chunks))
    return EXIT_OK


def _run_verify(args: argparse.Namespace) -> int:
    import json

    from dcpstudio.core import diff, open_checkpoint
    from dcpstudio.core.report import diff_json, diff_text

    bar = TerminalProgress() if not (args.quiet or args.json) else None
    try:
        with (
            open_checkpoint(args.a, trust_pickle=args.trust_pickle) as a,
            open_checkpoint(args.b, trust_pickle=args.trust_pickle) as b,
        ):
            report = diff(a, b, rtol=args.rtol, atol=args.atol, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps(diff_json(report)))
    else:
        print(diff_text(report))
    return EXIT_OK if report.equal else EXIT_ERROR


def _load_table(reports: list[Any], as_json: bool) -> int:
    import json
    from dataclasses import asdict

    from dcpstudio.core.report import human_bytes

    if as_json:
        print(json.dumps([{**asdict(r), "ok": r.ok} for r in reports]))
    else:
        print(f"{'rank':>4} {'load time':>10} {'received':>11} {'sent':>11} {'local':>11} {'peak RSS':>10}  check")
        for r in reports:
            check = f"ok ({r.checked} entries)" if r.ok else f"MISMATCH: {', '.join(r.mismatches[:5])}"
            print(
                f"{r.rank:>4} {r.seconds:>9.2f}s {human_bytes(r.bytes_received):>11} {human_bytes(r.bytes_sent):>11} "
                f"{human_bytes(r.local_bytes):>11} {human_bytes(r.peak_rss):>10}  {check}"
            )
    return EXIT_OK if all(r.ok for r in reports) else EXIT_ERROR


def _run_load(args: argparse.Namespace) -> int:
    from dcpstudio.core.load import load_rank, parse_mesh, run_load

    if args.ranks is None and "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        import torch.distributed as dist

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
            )
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object(report, gathered, dst=0)
        finally:
            dist.destroy_process_group()
        return _load_table(gathered, args.json) if gathered is not None else (EXIT_OK if report.ok else EXIT_ERROR)
    reports = run_load(
        args.path,
        ranks=args.ranks or 2,
        layout=args.layout,
        mesh=args.mesh,
        timeout=args.timeout,
        trust_pickle=args.trust_pickle,
    )
    return _load_table(reports, args.json)


def _cuda_per_rank() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _run_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dcpstudio.core import dcp_to_torch_save
    from dcpstudio.core.demo import write_demo

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


def _show_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    print(f"dcpstudio: warning: {message}", file=sys.stderr)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so every temporary output is removed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum: int, frame: Any) -> None:
    raise Terminated(signum)


def _catch_termination() -> None:
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), _on_signal)


def _error(text: object) -> None:
    from dcpstudio.core.model import printable

    lines = str(text).splitlines() or [""]
    print(f"dcpstudio: error: {printable(lines[0])}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "convert": _run_convert,
        "torch_to_dcp": _run_convert,
        "torch-to-dcp": _run_convert,
        "dcp_to_torch": _run_convert,
        "dcp-to-torch": _run_convert,
        "inspect": _run_inspect,
        "load": _run_load,
        "verify": _run_verify,
        "demo": _run_demo,
    }
    warnings.showwarning = _show_warning
    from dcpstudio.core.errors import CancelledError, DCPStudioError

    debug = bool(os.environ.get("DCPSTUDIO_DEBUG"))
    failed = EXIT_USAGE if args.command == "verify" else EXIT_ERROR  # 1 means "different" for verify
    try:
        if args.command is None or args.command == "open":
            from dcpstudio.app.main import run

            return run([args.path] if args.command == "open" else [], demo=args.demo, quit_after=args.quit_after)
        _catch_termination()
        return commands[args.command](args)
    except CancelledError:
        print("dcpstudio: cancelled; nothing was written", file=sys.stderr)
        return EXIT_CANCELLED
    except Terminated as e:
        print(f"\ndcpstudio: terminated ({signal.Signals(e.signum).name}); nothing was written", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("\ndcpstudio: interrupted; nothing was written", file=sys.stderr)
        return EXIT_CANCELLED
    except BrokenPipeError:  # the reader went away (| head): end quietly, like other tools
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (DCPStudioError, ValueError, KeyError) as e:
        if debug:
            raise
        _error(e.args[0] if isinstance(e, KeyError) and e.args else e)
        return EXIT_USAGE if isinstance(e, ValueError) and args.command != "verify" else failed
    except RecursionError:
        if debug:
            raise
        _error("the checkpoint nests its values too deeply to be read")
        return failed
    except MemoryError:
        if debug:
            raise
        _error("not enough memory for this checkpoint")
        return failed
    except Exception as e:
        if debug:
            raise
        if isinstance(e, RuntimeError) and "allocate" in str(e):  # torch's allocator: a plain lack of memory
            _error("not enough memory for this checkpoint")
            return failed
        first = str(e).splitlines()[0] if str(e) else ""
        _error(f"unexpected {type(e).__name__}: {first} (set DCPSTUDIO_DEBUG=1 for details)")
        return failed
