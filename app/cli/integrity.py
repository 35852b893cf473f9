"""``dcpstudio check`` and ``dcpstudio hash``: is one checkpoint whole, and the content digest of
each of its entries (:mod:`dcpstudio.core.ops.integrity`)."""

from __future__ import annotations

import argparse
import json

from .commands import EXIT_ERROR, EXIT_OK, TerminalProgress

__all__ = ["add_parsers", "run_check", "run_hash"]


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check", help="check that a checkpoint is whole: files, records, zstd frames, chunk tables (exit 1: findings)"
    )
    p.add_argument("path", help="any checkpoint: DCP directory, torch.save file(s), safetensors")
    p.add_argument("--values", action="store_true", help="also read every tensor: NaN/Inf counts, all-zero tensors")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p = sub.add_parser("hash", help="a content digest per entry, the same in every format: digest  dtype  shape  name")
    p.add_argument("path", help="any checkpoint: DCP directory, torch.save file(s), safetensors")
    p.add_argument("--json", action="store_true", help="the digests as JSON")
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run_check(args: argparse.Namespace) -> int:
    from dcpstudio.core.ops.integrity import check_path

    bar = TerminalProgress() if not args.quiet else None
    try:
        report = check_path(args.path, values=args.values, trust_pickle=args.trust_pickle, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(report.json(), indent=2) if args.json else report.text())
    return EXIT_OK if report.whole else EXIT_ERROR


def run_hash(args: argparse.Namespace) -> int:
    from dcpstudio.core import open_checkpoint
    from dcpstudio.core.ops.integrity import ALGORITHM, digests

    bar = TerminalProgress() if not args.quiet else None
    try:
        with open_checkpoint(args.path, trust_pickle=args.trust_pickle) as ckpt:
            found = digests(ckpt, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps({"algorithm": ALGORITHM, "entries": [d.json() for d in found]}, indent=2))
    else:
        print("\n".join(d.line() for d in found))
    return EXIT_OK
