"""``dcpstudio check`` and ``dcpstudio hash``: is one checkpoint whole, and the content digest of
each of its entries (:mod:`dcpstudio.core.ops.integrity`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .commands import EXIT_ERROR, EXIT_OK, TerminalProgress

__all__ = ["add_diff_parser", "add_parsers", "run_check", "run_diff_digests", "run_hash"]


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
    p.add_argument(
        "--manifest", action="store_true", help="also write a manifest beside it, for check and diff-digests"
    )
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def add_diff_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diff-digests",
        help="which tensors differ between two checkpoints, from their manifests alone (no tensor data read)",
    )
    p.add_argument("a", help="checkpoint A (with a manifest: written by DCP Studio or `hash --manifest`)")
    p.add_argument("b", help="checkpoint B, of any format")
    p.add_argument("--json", action="store_true", help="the answer as JSON")


def run_diff_digests(args: argparse.Namespace) -> int:
    from dcpstudio.core.ops.integrity.manifests import diff_digests

    d = diff_digests(args.a, args.b)
    print(json.dumps(d.json(), indent=2) if args.json else "\n".join(d.lines()))
    return EXIT_OK if d.equal else EXIT_ERROR


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
            if args.manifest:
                from dcpstudio.core.ops.integrity.manifests import write_manifest

                written = write_manifest(ckpt, _files_of(ckpt))
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps({"algorithm": ALGORITHM, "entries": [d.json() for d in found]}, indent=2))
    else:
        print("\n".join(d.line() for d in found))
    if args.manifest:
        print(f"manifest: {written}", file=sys.stderr)
    return EXIT_OK


def _files_of(ckpt: Any) -> list[Path]:
    """The files a checkpoint consists of: a directory's regular files (its own manifest not), or the file."""
    from dcpstudio.core.formats.manifest import MANIFEST_FILE

    p = Path(ckpt.path)
    if not p.is_dir():
        return [p]
    return sorted(f for f in p.iterdir() if f.is_file() and not f.is_symlink() and f.name != MANIFEST_FILE)
