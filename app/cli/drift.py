"""``dcpstudio drift RUN``: how every tensor of a training run moved across its checkpoints, and what
looks wrong (:mod:`dcpstudio.core.ops.drift`). Exit 0 when nothing is flagged, 1 with anomalies (or
on an error, as ``check`` does), 2 on a usage error."""

from __future__ import annotations

import argparse
import json
import sys

from .commands import EXIT_ERROR, EXIT_OK, TerminalProgress

__all__ = ["add_parser", "run_drift"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "drift",
        help="a run (a folder of step-N / checkpoint-N / …step=N.ckpt checkpoints): every tensor's change over "
        "steps, and the anomalies (exit 1: anomalies)",
        description="Read every checkpoint of a training run once and report, per tensor and step, its norm, "
        "relative change, cosine to the previous and first step, max |change| and NaN/Inf counts; flag "
        "spikes, frozen tensors, NaN/Inf appearing, steps reverted to earlier values and layout changes.",
    )
    p.add_argument("run", help="the run's folder (local or a URL), whose children are checkpoints named by step")
    p.add_argument(
        "--pattern",
        metavar="RE",
        help="the children's names: a regular expression with a group "
        "(?P<step>\\d+) (default: torchtitan, Hugging Face Trainer, Lightning, Megatron, DeepSpeed, "
        "plain numbers)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the report as JSON: steps, series, groups, values, anomalies")
    out.add_argument("--csv", action="store_true", help="the series as CSV: one row per step and entry")
    p.add_argument("--no-cache", action="store_true", help="compute every step again (and do not store the sums)")
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run_drift(args: argparse.Namespace) -> int:
    from dcpstudio.core.errors import DCPStudioError
    from dcpstudio.core.ops.drift import CONVENTIONS, detect_run, drift

    run = detect_run(args.run, pattern=args.pattern)
    if run is None:
        known = ", ".join(CONVENTIONS) if not args.pattern else f"--pattern {args.pattern!r}"
        raise DCPStudioError(f"{args.run}: not a run: no two checkpoints named by step in it ({known})")
    for name, why in run.skipped:
        print(f"dcpstudio: warning: {name} left out: {why}", file=sys.stderr)
    bar = TerminalProgress() if not args.quiet else None
    try:
        report = drift(run, trust_pickle=args.trust_pickle, cache=not args.no_cache, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    for note in report.notes:
        print(f"dcpstudio: warning: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.json(), indent=1, allow_nan=False))
    elif args.csv:
        sys.stdout.write(report.csv())
    else:
        print(report.text())
    return EXIT_ERROR if report.anomalies else EXIT_OK
