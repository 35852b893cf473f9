"""One conversion on many ranks (``torchrun … -m dcpstudio convert``, or ``convert --ranks N``):
the same output, byte for byte, as the single-process conversion, with the tensor bytes split
between the ranks by size, not by file.

Every rank plans the conversion itself (:func:`~..ops.convert.convert.convert` with a
:class:`~..ops.convert.layout.Recorder`) and lays the output out in a scratch folder of its own
(headers only: :func:`~..ops.convert.layout.lay_out`); the ranks check that their layouts agree.
Rank 0 makes the atomic temporary beside the destination, with every file at its final size; each
rank writes its share of the tensor bytes there with positioned writes and returns the CRC-32 of
each piece; rank 0 lays the output out again with the combined CRCs, copies in its headers, pickles,
ZIP directories and -- last -- ``.metadata`` or the index, flushes, and renames it into place.

With a manifest (the single-process writer reads its output back for one), the ranks read the
written bytes back instead: each rank its share of the tensors' 16 MiB pieces, and -- once rank 0
has copied in the final headers -- its share of the files' hashed spans
(:mod:`~..ops.convert.replay`); rank 0 lays the output out a last time with those digests in place
of a read-back, so the writer itself writes the manifest, where and as one process writes it.

Each step ends in a collective that carries every rank's error: a failure anywhere (an exception,
SIGTERM or SIGINT -- torchrun sends SIGTERM to the survivors when a rank dies -- or a rank killed
outright, which breaks its peers' connections) makes every rank raise, and rank 0 removes the
temporary: nothing is published and nothing is left. The destination must be a filesystem every
rank sees (a shared one across nodes) and that takes positioned writes, or S3, where each rank
uploads its parts of each object's multipart upload instead (:mod:`.upload`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import CancelledError, DCPStudioError
from ..io.remote.locations import RemotePath
from ..ops.convert.convert import convert
from ..ops.convert.layout import (
    Layout,
    Recorder,
    combine_crcs,
    create_files,
    lay_out,
    overlay,
    split_by_bytes,
)
from ..ops.convert.output import ConversionResult, Target, Writers, output_context
from ..ops.convert.pieces import write_pieces
from ..ops.convert.replay import Replay, balance, piece_digests, piece_jobs, span_digests
from ..progress import CancelToken, Progress, ProgressCallback
from .group import Group, TorchGroup
from .launch import PIPES
from .share import ShareProgress
from .upload import refuse_store as refuse_remote  # a remote destination other than S3 (multipart uploads)

__all__ = [
    "KILL_VARIABLE",
    "RankShare",
    "check_plan",
    "convert_on_ranks",
    "convert_rank",
    "refuse_remote",
    "run_convert",
]

KILL_VARIABLE = "DCPSTUDIO_TEST_KILL_RANK"  # fault injection: that rank kills itself after its first block
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@dataclass(frozen=True)
class RankShare:
    """What one rank did: its bytes of tensor data, in how many pieces, and how long it took."""

    rank: int
    nbytes: int
    pieces: int
    seconds: float


class _Failed(DCPStudioError):
    """A peer's error, raised on every rank after a collective that carried it."""


def _agree(group: Group, error: str | None, value: Any) -> list[Any]:
    """Every rank's ``value``, once no rank reported an ``error`` (else every rank raises it)."""
    gathered = group.all_gather((error, value))
    failed = [(r, e) for r, (e, _) in enumerate(gathered) if e is not None]
    if failed:
        r, e = failed[0]
        raise _Failed(e if e.startswith("rank ") else f"rank {r}: {e}")
    return [v for _, v in gathered]


def _message(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return text if isinstance(e, DCPStudioError) else f"{type(e).__name__}: {text}"


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGTERM raises :class:`CancelledError` (once) in the main thread, as SIGINT raises
    KeyboardInterrupt, so the temporary is removed on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup is not interrupted again
        raise CancelledError(f"stopped by {signal.Signals(signum).name}; nothing was written")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _plan(src: Any, dst: str, options: dict[str, Any], writers: Writers, assets: bool) -> ConversionResult:
    """Plan (and, with a distributed writer, carry out) the conversion as ``convert`` or -- with a
    ``mapping`` option -- ``map_convert`` does; ``assets``: copy a mapping's (rank 0, once written)."""
    options = dict(options)
    mapping, config = options.pop("mapping", None), options.pop("config", None)
    if mapping is None:
        return convert(src, dst, writers=writers, **options)
    from ..ops.mappings import map_convert

    done = map_convert(src, dst, mapping, config, writers=writers, copy_assets=assets, **options)
    assert done.result is not None
    return done.result


def check_plan(src: Any, dst: Any, options: dict[str, Any]) -> ConversionResult:
    """Everything a conversion refuses, refused here, writing nothing (before ranks start)."""
    refuse_remote(dst)
    return _plan(src, dst, options, Recorder().writers(), assets=False)


def convert_on_ranks(
    src: str,
    dst: str,
    options: dict[str, Any] | None = None,
    *,
    progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
    warn: bool = True,
    group: Group | None = None,
) -> tuple[ConversionResult, RankShare]:
    """This rank's part of converting ``src`` to ``dst`` (``options`` as for ``convert``, plus
    ``mapping`` and ``config`` as for ``map_convert``) in ``group`` (default: torch's initialised
    process group); every rank calls it with the same arguments. ``progress`` reports this rank's
    bytes; ``warn``: rank 0 issues the conversion's warnings."""
    group = group if group is not None else TorchGroup()
    rank = group.rank
    started = time.monotonic()
    entered = False
    shares: list[RankShare] = []

    def write(kind: Target, *args: Any, **kwargs: Any) -> None:
        nonlocal entered
        entered = True
        shares.append(_write(group, Recorder(kind, args, kwargs), progress, cancel, started))

    writers = Writers(partial(write, "torch"), partial(write, "dcp"), partial(write, "safetensors"))
    with _stopped_by_signals(), warnings.catch_warnings():
        if not (warn and rank == 0):  # said once: by rank 0, or by the parent that started the ranks
            warnings.simplefilter("ignore")
        try:
            refuse_remote(dst)
            result = _plan(src, dst, dict(options or {}), writers, assets=rank == 0)
        except _Failed:
            raise
        except Exception as e:
            if not entered:  # the others wait for this rank's layout: they are told, and all raise
                _agree(group, _message(e), None)
            raise
    return result, shares[0]


def _write(
    group: Group, recorder: Recorder, progress: ProgressCallback | None, cancel: CancelToken | None, started: float
) -> RankShare:
    """The writer a distributed conversion hands ``convert``: it runs while the source is open."""
    rank, world = group.rank, group.world
    if isinstance(recorder.args[0], RemotePath):  # S3: each rank uploads its parts of each object
        from .upload import Steps, upload_on_ranks

        agree, back = partial(_agree, group), partial(_read_back, group)
        steps = Steps(rank, world, agree, _message, back, KILL_VARIABLE, _SCRATCH)
        return RankShare(rank, *upload_on_ranks(recorder, progress, cancel, started, steps))
    with ExitStack() as stack:
        error: str | None = None
        digest = None
        scratch = Path(tempfile.mkdtemp(prefix="dcpstudio-layout-", dir=_SCRATCH))
        try:  # the layout is kept, its files are not: a rank killed later leaves nothing here
            layout = lay_out(recorder, scratch / recorder.dst.name)  # the name: a manifest holds it
            digest = layout.digest()
        except Exception as e:
            error = _message(e)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if len(set(_agree(group, error, digest))) != 1:
            raise DCPStudioError("the ranks planned different outputs: do they all see the same source and options?")
        pieces = split_by_bytes(layout, world)[rank]
        share = sum(p.end - p.start for p in pieces)

        stage: str | None = None
        error = None
        if rank == 0:
            try:
                tmp = stack.enter_context(
                    output_context(recorder.dst, recorder.overwrite, source=recorder.kwargs.get("source"))
                )
                create_files(layout, tmp)
                stage = str(tmp)
            except Exception as e:
                error = _message(e)
        stage = _agree(group, error, stage)[0]
        assert stage is not None

        tally = ShareProgress(rank, share, progress, cancel, KILL_VARIABLE)
        check = tally.check
        error = None
        crcs: list[tuple[int, int, int]] = []
        try:
            crcs = write_pieces(layout, pieces, Path(stage), tally.advance, check)
        except Exception as e:
            error = _message(e)
        everyone = [c for rank_crcs in _agree(group, error, crcs) for c in rank_crcs]

        crcs_all = combine_crcs(layout, everyone) if layout.crc else None
        if not layout.spans:  # no manifest
            _publish(group, recorder, layout, rank == 0, Path(stage), crcs_all, None, stack)
        else:  # the tensors' pieces, and the spans that are tensor bytes only, read back; each rank its share
            early = [k for k, span in enumerate(layout.spans) if _in_holes(layout, span)]
            digests, shas = _read_back(group, layout, Path(stage), True, early, check)
            late = [k for k in range(len(layout.spans)) if k not in shas]
            if late:  # the other spans once the headers are final (DCP data files, a torch.save prefix)
                _publish(group, recorder, layout, rank == 0, Path(stage), crcs_all, Replay(digests), None)
                shas.update(_read_back(group, layout, Path(stage), False, late, check)[1])
            replay = Replay(digests, [shas[k] for k in range(len(layout.spans))])
            kept = [layout.spans[k] for k in late]  # as hashed: laid out again, a DCP's archives get new ids
            _publish(group, recorder, layout, rank == 0, Path(stage), crcs_all, replay, stack, kept)
    return RankShare(rank, share, len(pieces), time.monotonic() - started)


def _in_holes(layout: Layout, span: tuple[str, int, int]) -> bool:
    """Whether the span's bytes are all tensor bytes (final once the ranks wrote them)."""
    name, at, end = span
    for offset, n in sorted((h[1], h[2]) for h in layout.holes if h[0] == name):
        if offset <= at < offset + n:
            at = offset + n
    return at >= end


def _read_back(
    group: Group, layout: Layout, stage: Path, pieces: bool, spans: list[int], check: Callable[[], None]
) -> tuple[list[list[Any]], dict[int, str]]:
    """This rank's share of the tensors' pieces (with ``pieces``) and of the hashed spans numbered
    ``spans``, read back from the output at ``stage``; every rank's, gathered: each tensor's piece
    digests in order, and each span's SHA-256."""
    jobs = piece_jobs(layout.tensors) if pieces else []
    spanned = [(k, *layout.spans[k]) for k in spans]
    costs = [j[3] * 7 // 5 for j in jobs] + [b - a for _, _, a, b in spanned]  # a piece: SHA-256 and moments
    picked = balance(costs, group.world)
    mine = sorted(picked[group.rank])
    error = None
    done: tuple[list[Any], list[tuple[int, str]]] = ([], [])
    try:
        done = (
            piece_digests(stage, [jobs[i] for i in mine if i < len(jobs)], check),
            span_digests(stage, [spanned[i - len(jobs)] for i in mine if i >= len(jobs)], check),
        )
    except Exception as e:
        error = _message(e)
    gathered = _agree(group, error, done)
    digests: list[list[Any]] = [[] for _ in layout.tensors]
    for k, _, piece in sorted((d for got in gathered for d in got[0]), key=lambda d: (d[0], d[1])):
        digests[k].append(piece)  # in the tensor's order: the ranks' pieces joined
    return digests, {k: sha for got in gathered for k, sha in got[1]}


def _publish(
    group: Group,
    recorder: Recorder,
    layout: Layout,
    lead: bool,
    stage: Path,
    crcs: list[int] | None,
    replay: Replay | None,
    stack: ExitStack | None,
    kept: list[tuple[str, int, int]] | None = None,
) -> None:
    """Rank 0 lays the output out again (``crcs``, ``replay``'s digests) inside the temporary --
    removed with it, or by the next run if this one dies -- and copies in what is not tensor bytes;
    ``kept``: spans left as they are. With ``stack``, it then publishes (the rename into place).
    Every rank waits for it."""
    error = None
    if lead:
        try:
            laid = stage.parent / ".dcpstudio-layout"
            shutil.rmtree(laid, ignore_errors=True)
            laid.mkdir()
            final = lay_out(recorder, laid / recorder.dst.name, crcs, replay)  # the name: a manifest holds it
            sizes = not layout.spans  # a manifest's length is known last
            if final.digest(sizes=sizes) != layout.digest(sizes=sizes):
                raise DCPStudioError("internal error: the output laid out again differs")
            overlay(final, laid / recorder.dst.name, stage, kept or ())
            shutil.rmtree(laid)
            if stack is not None:
                stack.close()
        except Exception as e:
            error = _message(e)
    _agree(group, error, None)


def convert_rank(
    rank: int,
    world: int,
    report: Callable[[str, float], None],
    src: str,
    dst: str,
    options: dict[str, Any],
    cwd: str,
) -> tuple[ConversionResult, RankShare]:
    """A rank started by :func:`~.launch.launch`: in its parent's folder (relative paths, and the
    DCP ``checkpoint_id`` made of one, are the parent's), its progress sent to the parent."""
    from .launch import rank_group

    os.chdir(cwd)

    def progress(p: Progress) -> None:
        report("convert", p.fraction)

    return convert_on_ranks(src, dst, options, progress=progress, warn=False, group=rank_group())


def run_convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    ranks: int,
    timeout: float = 600.0,
    on_progress: Any = None,
    cancel: CancelToken | None = None,
    preload: Sequence[str] | None = None,
    fork_parent: bool = False,
    **options: Any,
) -> tuple[ConversionResult, list[RankShare]]:
    """Convert ``src`` to ``dst`` on ``ranks`` local ranks (``options`` as for ``convert``): the
    conversion is planned here first, so a bad option or destination is refused before any rank
    starts (the ranks' fork server already starting meanwhile). The ranks are linked by pipes,
    not a torch process group. ``preload``: what their fork server imports (default: torch, for a
    process that launches ranks again and again; a one-off command passes
    :data:`~.launch.LIGHT_PRELOAD`, and its ranks import torch only if the conversion computes with
    it). ``fork_parent``: the ranks are forks of this process where it can be forked
    (:func:`~.launch.can_fork_parent`; a one-off command: this module is imported and the plan
    made). The result, and each rank's share."""
    from .launch import DEFAULT_PRELOAD, can_fork_parent, launch, prestart

    if ranks < 1:
        raise ValueError("ranks must be at least 1")
    preload = DEFAULT_PRELOAD if preload is None else preload
    fork_parent = fork_parent and can_fork_parent()
    if not fork_parent:
        prestart((*preload, __name__))
    src_s = src.url if isinstance(src, RemotePath) else os.fspath(src)
    dst_s = dst.url if isinstance(dst, RemotePath) else os.fspath(dst)
    check_plan(src_s, dst_s, options)
    args = (src_s, dst_s, options, os.getcwd())
    out = launch(
        convert_rank,
        args,
        nprocs=ranks,
        timeout=timeout,
        on_progress=on_progress,
        cancel=cancel,
        backend=PIPES,
        preload=preload,
        fork_parent=fork_parent,
    )
    return out[0][0], [share for _, share in out]
