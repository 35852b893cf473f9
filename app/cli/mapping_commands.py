"""The command line's model mappings: ``convert --mapping``, ``verify --mapping`` and ``mappings``
(see :mod:`dcpstudio.core.ops.mappings`)."""

from __future__ import annotations

import argparse
import time

from .flags import UsageError, convert_options

__all__ = ["check_mapping_flags", "run_map_convert", "run_map_verify", "run_mappings"]

_EXCLUSIVE = ("include", "exclude", "dtype", "strip_prefix", "files", "max_file_size", "for_ranks", "layout", "mesh")


def check_mapping_flags(args: argparse.Namespace) -> bool:
    """Whether the command maps; a mapping flag without ``--mapping``, ``--mapping`` without
    ``--config``, or a selection/cast flag beside it, is a usage error naming the flag."""
    mapping = getattr(args, "mapping", None)
    if mapping is None:
        for flag in ("config", "hf_assets"):
            if getattr(args, flag, None) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} applies with --mapping only")
        for flag in ("dry_run", "allow_unmapped"):
            if getattr(args, flag, False):
                raise UsageError(f"--{flag.replace('_', '-')} applies with --mapping only")
        return False
    if args.config is None:
        raise UsageError("--mapping needs --config: the model's Hugging Face config.json (heads, layers, experts)")
    for flag in _EXCLUSIVE:
        if getattr(args, flag, None) not in (None, False):
            raise UsageError(
                f"--{flag.replace('_', '-')} does not combine with --mapping (the mapping says what is written)"
            )
    return True


def run_map_convert(args: argparse.Namespace, bar: object) -> int:
    from dcpstudio.core.ops.mappings import map_convert
    from dcpstudio.core.ops.report import human_bytes, plural

    start = time.monotonic()
    done = map_convert(
        args.src,
        args.dst,
        args.mapping,
        args.config,
        to=getattr(args, "to", None),
        dry_run=args.dry_run,
        progress=bar,
        **convert_options(args, mapping=True),
    )
    if args.dry_run:
        print(done.plan.text())
        return 0
    if not args.quiet:
        for note in done.plan.notes():
            print(f"dcpstudio: {note}")
        r = done.result
        assert r is not None
        extra = f"; copied {', '.join(done.assets)}" if done.assets else ""
        print(
            f"wrote {r.dst} ({r.target}, {done.plan.target} names via {done.plan.mapping.name}): "
            f"{plural(r.tensors, 'tensor')}, {human_bytes(r.tensor_bytes)} in {time.monotonic() - start:.2f} s"
            f"{extra}"
        )
    return 0


def run_map_verify(args: argparse.Namespace, bar: object) -> int:
    import json

    from dcpstudio.core.ops.mappings import map_verify
    from dcpstudio.core.ops.report import LIST_LIMIT, diff_json, diff_text

    if args.rtol or args.atol:
        raise UsageError("--rtol/--atol do not apply with --mapping: a mapping moves values, so they compare exactly")
    plan, report = map_verify(
        args.a,
        args.b,
        args.mapping,
        args.config,
        allow_unmapped=args.allow_unmapped,
        trust_pickle=args.trust_pickle,
        progress=bar,
    )
    through = f"A is the source through {plan.mapping.name} ({plan.target} names): {len(plan.outputs)} entries"
    if args.json:
        print(
            json.dumps(
                {
                    **diff_json(report),
                    "mapping": plan.mapping.name,
                    "direction": plan.direction,
                    "mapped_entries": len(plan.outputs),
                }
            )
        )
    else:
        first, *rest = diff_text(report, None if args.all else LIST_LIMIT).split("\n")
        print("\n".join([first, through, *plan.notes(), *rest]))
    return 0 if report.equal else 1


def run_mappings(args: argparse.Namespace) -> int:
    from dcpstudio.core.ops.mappings import list_mappings

    for name, description in list_mappings():
        print(f"{name:<26} {description}")
    return 0
