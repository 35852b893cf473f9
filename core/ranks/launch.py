"""Start N local ranks with ``multiprocessing`` and supervise them.

Ranks are forked from a fork server -- a fresh interpreter, started once per parent process, that
has imported what ``preload`` names (by default torch and torch.distributed.checkpoint: seconds
each, in every rank, when spawned) -- or spawned where there is no fork server. They fork the
parent itself only when it asks for it (``fork_parent``: a one-off command, which has planned
already and has imported what a rank needs) and :func:`can_fork_parent` holds: one thread, no Qt
application -- a fork then costs milliseconds where a fork server's start and imports cost a few
tenths of a second before any rank runs. They take the parent's environment of the moment,
join a process group on a free port (gloo on CPU, nccl when every rank can have a GPU) -- or, with
the :data:`PIPES` backend, are linked by pipes and import no torch (:mod:`.group`) -- and run
``fn(rank, world, report, *args)``; :func:`rank_group` is their group.
They talk to the parent only through a queue: progress, a result, or an error. The parent waits
with timeouts only; when a rank raises or dies, the others are stopped, the error is raised with
its rank, and no process is left behind.
"""

from __future__ import annotations

import multiprocessing as mp  # not torch's: only progress and results cross the queue; the parent needs no torch
import os
import queue
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import CancelledError, DCPStudioError
from ..progress import CancelToken
from .group import Group, PipeGroup, TorchGroup

__all__ = [
    "DEFAULT_PRELOAD",
    "LIGHT_PRELOAD",
    "PIPES",
    "LaunchError",
    "RankProgress",
    "can_fork_parent",
    "free_port",
    "launch",
    "prestart",
    "rank_group",
    "startup_seconds",
]

PIPES = "pipes"
"""The backend of ranks linked by pipes (:class:`~.group.PipeGroup`): no torch, no process group."""

LIGHT_PRELOAD = ("numpy",)
"""The preload of ranks that may not need torch (a command that launches once: ``convert --ranks``)."""
DEFAULT_PRELOAD = (  # what a loading rank imports: torch's (seconds) and the few of ours above it
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "dcpstudio.core.ranks.distributed",
    "dcpstudio.core.formats.dcp.storage",
    "dcpstudio.core.formats.dcp.planners",
)
_startup: float | None = None
_group: PipeGroup | None = None


class LaunchError(DCPStudioError):
    """A rank failed, died or timed out; the message names the rank."""


@dataclass(frozen=True)
class RankProgress:
    rank: int
    stage: str
    fraction: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def startup_seconds() -> float | None:
    """In a rank started by :func:`launch`: seconds from the ``launch`` call until the rank had
    joined the process group (start, imports, rendezvous); None in any other process."""
    return _startup


def rank_group() -> Group:
    """In a rank started by :func:`launch`: its group (pipes, or torch's process group)."""
    return _group if _group is not None else TorchGroup()


def prestart(preload: Sequence[str]) -> None:
    """Start the fork server now, importing ``preload`` (name the ranks' function's module too),
    so that its imports run while the caller still imports and plans; :func:`launch` then forks
    from it (a server already running keeps what it has)."""
    if "forkserver" in mp.get_all_start_methods():
        from multiprocessing import forkserver

        mp.get_context("forkserver").set_forkserver_preload(list(preload))
        forkserver.ensure_running()


_QT_CORES = ("PySide6.QtCore", "PyQt6.QtCore", "PySide2.QtCore", "PyQt5.QtCore")


def _qt_application() -> bool:
    """Whether a Qt application object exists here (its event loop, sockets to a display and
    timers would be copied, half alive, into a child). Qt merely imported is not one: a frozen
    build's Qt hook imports QtCore in every process, the command line's included."""
    for name in _QT_CORES:
        core = getattr(sys.modules.get(name), "QCoreApplication", None)
        if core is not None and core.instance() is not None:
            return True
    return False


def can_fork_parent() -> bool:
    """Whether this process can be forked safely: the start method exists, and the process runs
    one thread (every native thread counted: a fork keeps only the caller's, and a lock another
    held stays held in the child) and has no Qt application."""
    if "fork" not in mp.get_all_start_methods() or _qt_application():
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # no procfs: the threads cannot be counted
        return False


def _context(fn: Any, preload: Sequence[str], fork_parent: bool = False) -> Any:
    if fork_parent and can_fork_parent():
        return mp.get_context("fork")
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    module = getattr(fn, "__module__", None)  # a __main__ would be run again in the server: not preloaded
    ctx.set_forkserver_preload([*preload, *([module] if module and module != "__main__" else [])])
    return ctx


def _entry(
    rank: int,
    world: int,
    port: int,
    backend: str,
    timeout: float,
    fn: Any,
    args: tuple[Any, ...],
    q: Any,
    env: dict[str, str],
    launched_at: float,
    links: Sequence[Any] = (),
    foreign: Sequence[Any] | None = None,
) -> None:
    if foreign is not None:  # forked from the parent: its peers' pipe ends and the parent's handlers
        for conn in foreign:  # a peer's death must close its pipe
            conn.close()
        for name in ("SIGTERM", "SIGHUP"):  # as a fork server's rank: stopped by them, silently
            if hasattr(signal, name):
                signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()  # a forked rank starts with the fork server's environment, from its start
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    if backend == PIPES:
        _run_piped(rank, world, fn, args, q, env, launched_at, links)
        return
    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" not in env:  # like torchrun: ranks that share the cores do not each take all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    def connect() -> Callable[[], None]:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        return dist.destroy_process_group

    _serve(rank, world, fn, args, q, launched_at, connect)


def _serve(
    rank: int, world: int, fn: Any, args: tuple[Any, ...], q: Any, launched_at: float, connect: Callable[[], Any]
) -> None:
    """Links the rank to its peers (``connect()``, which returns how to unlink it), runs ``fn`` and
    reports its result -- or its error, to the parent, which stops the others."""
    global _startup
    try:
        close = connect()
        _startup = time.time() - launched_at
        try:
            result = fn(rank, world, lambda stage, fraction: q.put(("progress", rank, (stage, fraction))), *args)
        finally:
            close()
        q.put(("result", rank, result))
    except BaseException as e:
        q.put(("error", rank, _error_text(e)))


def _run_piped(
    rank: int, world: int, fn: Any, args: tuple[Any, ...], q: Any, env: dict[str, str], launched_at: float, links: Any
) -> None:
    """A rank linked to its peers by pipes: torch is imported only if ``fn`` needs it."""
    if "OMP_NUM_THREADS" not in env:  # as for gloo ranks, should torch be loaded
        threads = max(1, (os.cpu_count() or 1) // world)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:  # a fork server kept from an earlier launch
            sys.modules["torch"].set_num_threads(threads)

    def connect() -> Callable[[], None]:
        global _group
        _group = PipeGroup(rank, world, links)
        return _group.close

    _serve(rank, world, fn, args, q, launched_at, connect)


def _links(ctx: Any, nprocs: int) -> list[list[Any]]:
    """Each rank's pipes: rank 0's to every other rank, each other rank's to rank 0."""
    links: list[list[Any]] = [[] for _ in range(nprocs)]
    for r in range(1, nprocs):
        hub, spoke = ctx.Pipe()
        links[0].append(hub)
        links[r].append(spoke)
    return links


def _stop(procs: list[Any]) -> None:
    procs = [p for p in procs if p.pid is not None]  # started
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2)


def _died(rank: int, code: int | None) -> LaunchError:
    if code is not None and code < 0:
        try:
            how = signal.Signals(-code).name
        except ValueError:
            how = f"signal {-code}"
        return LaunchError(f"rank {rank} was killed ({how})")
    return LaunchError(f"rank {rank} exited with code {code} without a result")


def _error_text(e: BaseException) -> str:
    """A rank's error for the parent: our own errors' first line as they read (they are written for
    the user), anything else with its type."""
    text = str(e).splitlines()[0] if str(e) else ""
    return text if isinstance(e, DCPStudioError) and text else f"{type(e).__name__}: {text}"


def _is_echo(message: str) -> bool:
    """Errors a rank gets because a peer failed first (its connections dropped)."""
    return ("Connection" in message and ("peer" in message or "reset" in message)) or "left the conversion" in message


def _root_cause(procs: list[Any], results: dict[int, Any], q: Any, rank: int, message: str) -> LaunchError:
    """When one rank fails, its peers fail too; name the rank that failed first."""
    errors = [(rank, message)]
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        try:
            kind, r, payload = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if kind == "error":
            errors.append((r, str(payload)))
    dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive() and p.exitcode]
    if dead:
        echoes = "; ".join(f"then rank {r}: {m[:120]}" for r, m in errors)
        return LaunchError(f"{_died(dead[0], procs[dead[0]].exitcode)}; {echoes}")
    first = next(((r, m) for r, m in errors if not _is_echo(m)), errors[0])
    return LaunchError(first[1] if first[1].startswith("rank ") else f"rank {first[0]}: {first[1]}")


def launch(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    nprocs: int,
    timeout: float = 600.0,
    on_progress: Callable[[RankProgress], None] | None = None,
    cancel: CancelToken | None = None,
    backend: str | None = None,
    preload: Sequence[str] = DEFAULT_PRELOAD,
    fork_parent: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world, report, *args)`` on ``nprocs`` spawned ranks; their results in rank order.

    ``fn`` must be importable by name (module level). ``report(stage, fraction)`` sends progress.
    ``preload``: what the fork server imports once for every rank (beside ``fn``'s module); a fork
    server already running keeps what it has. ``fork_parent``: fork this process instead, when
    :func:`can_fork_parent` (else the fork server).
    """
    if nprocs < 1:
        raise ValueError("nprocs must be at least 1")
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"
    launched_at = time.time()
    ctx = _context(fn, preload, fork_parent)
    forked = ctx.get_start_method() == "fork"
    if forked:  # what this process has buffered would be written again by each rank
        sys.stdout.flush()
        sys.stderr.flush()
    q = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    links = _links(ctx, nprocs) if backend == PIPES else [[] for _ in range(nprocs)]

    def foreign(r: int) -> list[Any] | None:
        return [c for other, own in enumerate(links) if other != r for c in own] if forked else None

    procs = [
        ctx.Process(
            target=_entry,
            args=(r, nprocs, port, backend, timeout, fn, args, q, env, launched_at, links[r], foreign(r)),
            daemon=True,
            name=f"dcpstudio-rank{r}",
        )
        for r in range(nprocs)
    ]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        try:
            for p in procs:
                p.start()
        finally:  # the ranks hold their own ends: a rank's death must close its pipe for its peers
            for conn in (c for rank_links in links for c in rank_links):
                conn.close()
        while len(results) < nprocs:
            if cancel is not None and cancel.cancelled:
                raise CancelledError("cancelled; the ranks were stopped")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"ranks {sorted(set(range(nprocs)) - set(results))} did not finish in {timeout:.0f} s"
                )
            try:
                kind, rank, payload = q.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in results and not p.is_alive():
                        try:  # its last message may still be in flight
                            kind, rank, payload = q.get(timeout=0.5)
                        except queue.Empty:
                            raise _died(r, p.exitcode) from None
                        break
                else:
                    continue
            if kind == "progress":
                if on_progress is not None:
                    on_progress(RankProgress(rank, *payload))
            elif kind == "result":
                results[rank] = payload
            else:
                raise _root_cause(procs, results, q, rank, str(payload))
    finally:
        _stop(procs)
        q.cancel_join_thread()
        q.close()
    return [results[r] for r in range(nprocs)]
