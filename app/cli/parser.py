"""The ``dcpstudio`` command line's grammar: its subcommands, their arguments and help."""

from __future__ import annotations

import argparse

from .drift import add_parser as add_drift
from .integrity import add_diff_parser
from .integrity import add_parsers as add_integrity


def _add_convert_options(p: argparse.ArgumentParser, dst: str = "destination path") -> None:
    p.add_argument("src", help="source checkpoint (DCP directory, torch.save file or safetensors)")
    p.add_argument("dst", help=dst)
    p.add_argument("--include", metavar="RE", help="keep only entries whose name matches RE (re.search)")
    p.add_argument("--exclude", metavar="RE", help="drop entries whose name matches RE (re.search)")
    p.add_argument(
        "--allow-empty", action="store_true", help="write the output even when --include/--exclude keep no entry"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    p.add_argument(
        "--no-manifest",
        dest="manifest",
        action="store_false",
        help="write no manifest (tensor digests and moments, file SHA-256) with the output: faster, "
        "but check cannot then find a changed byte or a swapped file",
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="unpickle without restrictions (runs code embedded in the checkpoint; only for files you trust)",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="with --trust-pickle: write tensor subclasses (torchao Float8Tensor, Int8Tensor…) as their "
        "dequantize() instead of their inner tensors (NAME.qdata, NAME.scale)",
    )
    p.add_argument(
        "--allow-expansion",
        action="store_true",
        help="write an output many times larger than what the source stores (one storage viewed under many names)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")


def _add_pair(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="checkpoint A: DCP directory, torch.save file or safetensors (file or directory)")
    p.add_argument("b", help="checkpoint B, of any format")
    p.add_argument(
        "--rtol", type=float, default=0.0, help="relative tolerance: |a - b| <= atol + rtol·|b| (default: 0, exact)"
    )
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default: 0, exact)")


def _add_transform(p: argparse.ArgumentParser) -> None:
    """``verify``'s view of A through a conversion: the options of ``convert`` that change entries."""
    g = p.add_argument_group("A as converted (the options B was written with)")
    g.add_argument("--include", metavar="RE", help="only A's entries whose name matches RE (re.search)")
    g.add_argument("--exclude", metavar="RE", help="not A's entries whose name matches RE (re.search)")
    g.add_argument(
        "--dtype", "--cast", choices=["bf16", "fp16", "fp32"], help="A's floating-point tensors cast by torch first"
    )
    g.add_argument("--strip-prefix", metavar="PREFIX", help="PREFIX dropped from A's names (safetensors B only)")
    g.add_argument("--allow-empty", action="store_true", help="accept --include/--exclude that keep no entry")


def _add_mapping(p: argparse.ArgumentParser, convert: bool) -> None:
    g = p.add_argument_group("model mapping (torchtitan <-> Hugging Face names; `dcpstudio mappings` lists them)")
    g.add_argument("--mapping", metavar="NAME|RULES.toml", help="a built-in mapping or a TOML file of rules")
    g.add_argument("--config", metavar="CONFIG.json", help="the model's Hugging Face config.json (heads, layers...)")
    g.add_argument(
        "--allow-unmapped",
        action="store_true",
        help="pass entries no rule matches through unchanged, and map a source that lacks entries the config implies",
    )
    if convert:
        g.add_argument("--hf-assets", metavar="DIR", help="copy config, tokenizer and generation files from DIR")
        g.add_argument("--dry-run", action="store_true", help="print the plan (source -> operation -> name, shape, "
                       "dtype) and write nothing")  # fmt: skip


def _add_ranks(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "distributed conversion (also under torchrun: `torchrun --nproc-per-node N -m dcpstudio convert ...`)"
    )
    g.add_argument(
        "--ranks",
        type=int,
        metavar="N",
        help="convert on N local ranks, the tensor bytes split between them by size (the output is what one process "
        "writes, byte for byte, its manifest too where it writes one); omit under torchrun",
    )
    g.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds before the ranks give up on each other (default: 1800)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcpstudio",
        description="Convert, inspect and load PyTorch checkpoints: DCP directories, torch.save files, safetensors.",
    )
    from .. import __version__

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

    p = sub.add_parser("convert", help="convert a checkpoint (target from the destination's name, or --to)")
    _add_convert_options(p, "destination path; without --to its name decides the format (see --to)")
    p.add_argument(
        "--to",
        choices=["dcp", "torch", "safetensors"],
        help="target format (default: from DST: .pt/.pth/.bin torch.save, .safetensors safetensors, a trailing / "
        "or no suffix a directory -- DCP, or sharded safetensors with --max-shard-size; any other suffix: "
        "DCP <-> torch.save, safetensors -> DCP)",
    )
    p.add_argument("--max-shard-size", metavar="SIZE", help="safetensors: shards of at most SIZE (5GB, 500MiB) + index")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating-point tensors")
    p.add_argument("--strip-prefix", metavar="PREFIX", help="safetensors: drop PREFIX from names (e.g. 'model.')")
    p.add_argument("--files", type=int, metavar="N", help="DCP: spread the data over N files")
    p.add_argument("--max-file-size", metavar="SIZE", help="DCP: data files of at most SIZE (5GB, 500MiB)")
    g = p.add_argument_group("offline resharding (DCP target laid out for a job's ranks)")
    g.add_argument(
        "--for-ranks",
        type=int,
        metavar="N",
        help="DCP: lay the output out for N ranks, each rank's chunks in its own file __R_0.distcp",
    )
    g.add_argument(
        "--layout",
        choices=["replicate", "shard0", "shard1", "fsdp"],
        help="with --for-ranks: the target layout, as `load` places tensors (default: shard0)",
    )
    g.add_argument("--mesh", metavar="SHAPE", help="with --for-ranks: the device mesh, e.g. 2x2 (default: 1-D)")
    _add_mapping(p, convert=True)
    _add_ranks(p)
    for name, text in (
        ("torch_to_dcp", "torch.save file -> DCP directory (format_utils' argument order)"),
        ("dcp_to_torch", "DCP directory -> torch.save file (format_utils' argument order)"),
    ):
        p = sub.add_parser(name, help=text, aliases=[name.replace("_", "-")])
        _add_convert_options(p)
        p.set_defaults(named=name)

    sub.add_parser("mappings", help="list the built-in model mappings (for convert/verify --mapping)")

    p = sub.add_parser("inspect", help="show what a checkpoint holds, without loading its tensors")
    p.add_argument("path", help="DCP directory, torch.save file or safetensors file/directory")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema in dcpstudio.core.ops.report)")
    p.add_argument("--chunks", action="store_true", help="list each tensor's chunks with their files and bytes")
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")

    p = sub.add_parser(
        "verify",
        help="check that two checkpoints of any formats hold the same entries and values "
        "(exit 0 equal, 1 different, 2 error)",
        description="Check that A and B hold the same entries with the same values, whatever their formats: "
        "a summary of counts, then each difference. Exit 0 when equal within the tolerances, 1 when not, 2 on error. "
        "To verify a conversion's output B against its source A, give the options it was converted with "
        "(--include, --exclude, --dtype, --strip-prefix): B is compared with A as the conversion wrote it, "
        "casts exactly (A cast by torch, as convert does).",
    )
    _add_pair(p)
    _add_transform(p)
    _add_mapping(p, convert=False)
    p.add_argument(
        "--quick",
        action="store_true",
        help="read each tensor only up to its first differing block: where it differs, not how much",
    )
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.add_argument(
        "-v",
        "--verbose",
        "--all",
        dest="all",
        action="store_true",
        help="list every difference (default: 20 of each kind)",
    )
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "compare",
        help="compare two checkpoints entry by entry: status, max |Δ|, relative L2, cosine (the window's compare view)",
        description="Every entry of A and B compared, as the window's compare view shows it: its status, the "
        "largest |a - b|, the relative L2 change ‖a - b‖/‖a‖ and the cosine similarity. Exit 0 when every entry "
        "is equal within the tolerances, 1 when not, 2 on error.",
    )
    _add_pair(p)
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="the rows as JSON (schema in dcpstudio.core.ops.report)")
    out.add_argument("--csv", action="store_true", help="the rows as CSV, metrics at full precision")
    p.add_argument("--differences-only", action="store_true", help="leave out the entries that are equal")
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "load",
        help="load a checkpoint on N ranks in a layout and check every shard (also under torchrun)",
    )
    p.add_argument("path", help="any checkpoint: DCP directory, torch.save file(s), safetensors")
    p.add_argument(
        "--ranks",
        type=int,
        metavar="N",
        help="local ranks to spawn, at least 1 (default: 2, or the size of --mesh; omit under torchrun)",
    )
    p.add_argument(
        "--layout",
        default="shard0",
        choices=["replicate", "shard0", "shard1", "fsdp"],
        help="how each tensor is placed on the mesh: replicated, sharded on dim 0 or 1, or FSDP-style "
        "(default: shard0)",
    )
    p.add_argument(
        "--mesh", metavar="SHAPE", help="device mesh shape, at most 2-D, e.g. 2x2 (default: 1-D over all ranks)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are stopped (default: 600)")
    p.add_argument(
        "--stream",
        action="store_true",
        help="every rank gets its bytes from the coordinator (as across hosts), even where it could read the files",
    )
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")
    p.add_argument("--json", action="store_true", help="per-rank reports as JSON")

    p = sub.add_parser("export", help="write one tensor to a .npy or .pt file (streamed: any size)")
    p.add_argument("path", help="any checkpoint: DCP directory, torch.save file(s), safetensors")
    p.add_argument("name", help="the tensor's fully-qualified name (as `dcpstudio inspect` lists it)")
    p.add_argument("dst", help="the file to write: .npy (NumPy) or .pt (torch.load returns the tensor)")
    p.add_argument("--format", choices=["npy", "pt"], help="file format (default: from the suffix of DST)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")
    p.add_argument("--trust-pickle", action="store_true", help="unpickle without restrictions (runs embedded code)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")

    add_integrity(sub)
    add_diff_parser(sub)
    add_drift(sub)

    p = sub.add_parser(
        "open",
        help="open the window on a checkpoint",
        description="Open the DCP Studio window on a checkpoint (a display is needed: xvfb-run on a headless machine).",
    )
    p.add_argument("path", help="any checkpoint: DCP directory, torch.save file, safetensors file or directory")

    p = sub.add_parser("demo", help="write a demo torch.save file and DCP checkpoint, convert and check them")
    p.add_argument("--dir", help="where to write (default: the user data directory)")
    return parser
