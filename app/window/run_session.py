"""The window's run: a folder of one training run's checkpoints, analysed as a job and shown in the
Run view, with the tree (which shows one step's checkpoint) shaded by that step's change.

The window opens a run like a checkpoint (File › Open as Run…, or any folder
:func:`~dcpstudio.core.ops.drift.detect_run` recognises): its latest step is opened in the tree and
:meth:`RunSession.show` starts :func:`~dcpstudio.core.ops.drift.drift` as the ``drift`` job --
progress and Cancel in the Run view, which it makes (and pyqtgraph is imported) the first time.
Choosing a step opens that step's checkpoint; clicking a point of the plot at step k opens step k-1
and compares it with step k in the Compare view on that entry only (a tensor, or a module's entries),
the entry selected -- Compare Everything there widens it to the whole steps. What is asked of a step waits
in :attr:`RunSession.pending` until the window has opened it (:meth:`opened`).

A step's checkpoint names its entries without the prefix its part has in the run (a Hugging Face
Trainer folder's weights are ``model.*`` in the report, beside ``optimizer.*``): names cross that
boundary through :meth:`report_name` and :meth:`checkpoint_name`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt

from dcpstudio.core import Checkpoint, DCPStudioError, Node
from dcpstudio.core.checkpoints.model import printable

from .locations import is_remote, location
from .notify import describe

__all__ = ["RunSession", "detect_local_run"]


def detect_local_run(path: Any, required: bool, pattern: str | None = None) -> Any:
    """The run at ``path`` (on the worker that opens it), or None: every local folder opened is
    asked (a listing, no tensor read); with ``required`` (Open as Run) any location, and a folder
    that is not a run is refused. ``pattern``: the checkpoints' names (see ``detect_run``)."""
    if not required and (is_remote(path) or not Path(path).is_dir()):
        return None
    from dcpstudio.core.ops.drift.run import detect_run

    run = detect_run(path, pattern)
    if run is None and required:
        names = f"named by {pattern}" if pattern else "named by step (step-100, checkpoint-500, iter_0001000, …)"
        raise DCPStudioError(
            f"{path} is not a run: a run folder holds two or more checkpoints {names}; "
            "File › Open as Run… takes a pattern for other names"
        )
    if run is not None:
        import pyqtgraph  # noqa: F401  - the Run view's, imported here: ~0.1 s less on the GUI thread
    return run


def _same(a: Any, b: Any) -> bool:
    return str(a) == str(b)


class RunSession:
    """The run shown by ``window`` (the main window, typed loosely: it imports this module)."""

    def __init__(self, window: Any) -> None:
        self.w = window
        self.view: Any = None  # the RunView, made with the first run
        self.run: Any = None
        self.report: Any = None
        self.position: int | None = None  # the step the tree shows (and is shaded by)
        self.pending: tuple[str, Callable[[Checkpoint], None]] | None = None  # (location, then)
        self.patterns: dict[str, str] = {}  # a folder opened as a run -> the names given for its steps

    # -- opening ----------------------------------------------------------------------------------
    def ask_run(self) -> tuple[str, str | None] | None:
        """The folder and the names' pattern from File › Open as Run… (tests answer it)."""
        from .widgets.open_run import OpenRunDialog

        dialog = OpenRunDialog(self.w.settings.last_dir(), self.w)
        return dialog.choice() if dialog.exec() == OpenRunDialog.DialogCode.Accepted else None

    def ask_open(self) -> None:
        got = self.ask_run()
        if got is None:
            return
        folder, pattern = got
        where = location(folder if is_remote(folder) else Path(folder).expanduser())
        if pattern:
            self.patterns[str(where)] = pattern
        else:
            self.patterns.pop(str(where), None)
        self.w.open_path(where, as_run=True)

    def detector(self, path: Any, as_run: bool) -> Callable[[], Any]:
        """What the window's open job calls (on its worker) to find the run at ``path``."""
        pattern = self.patterns.get(str(path)) if as_run else None
        return lambda: detect_local_run(path, as_run, pattern)

    # -- showing a run ----------------------------------------------------------------------------
    def _make_view(self) -> Any:
        from .widgets.run_view import RunView  # imports pyqtgraph: only once a run is shown

        view = RunView()
        view.step_chosen.connect(self.choose_step)
        view.compare_requested.connect(self.compare)
        view.entry_requested.connect(self.select_entry)
        view.cancel_button.clicked.connect(lambda: self.w.board.cancel("drift"))
        view.again_button.clicked.connect(self.reread)
        self.w.views.addTab(view, "Run")
        return view

    def show(self, run: Any) -> None:
        """Show ``run`` (its latest step is the checkpoint the window just opened) and analyse it."""
        if self.view is None:
            self.view = self._make_view()
        self.run, self.report = run, None
        self.position = len(run.steps) - 1
        if not is_remote(run.location):
            self.w.settings.add_recent(run.location)  # reopened from the recent list, it is a run again
        self.view.show_run(run)
        self.view.choose_step(self.position)
        self.w.views.setCurrentWidget(self.view)
        self.w.setWindowTitle(f"DCP Studio — run {printable(Path(str(run.location)).name)}")
        self.analyse()

    def show_view(self) -> None:
        """View › Run: the Run view, when a run was opened."""
        if self.view is None:
            self.w.notifier.info("No run is open: File › Open as Run… opens a folder of checkpoints by step.")
            return
        self.w.views.setCurrentWidget(self.view)
        self.view.steps.setFocus(Qt.FocusReason.ShortcutFocusReason)

    def analyse(self) -> Any:
        run, view = self.run, self.view
        view.set_busy(True)

        def work(progress: Any, cancel: Any) -> tuple[Any, Any]:
            from dcpstudio.core.ops.drift import drift

            from .widgets.run_heat import heat_rgba

            report = drift(run, progress=progress, cancel=cancel)
            changes = [series.get("rel_change", [None] * len(report.steps)) for series in report.series.values()]
            return report, heat_rgba(changes)  # the heat map's cells: millions for a large run

        def ended(text: str, state: str) -> None:
            if self.run is run:
                view.say(text, state)

        board = self.w.board
        job = board.start("drift", work, lambda r: self._analysed(run, *r), lambda: self._idle(run), self._progress)
        job.errored.connect(lambda e: ended(f"Not analysed: {describe(e)}", "error"))
        job.cancelled.connect(lambda: ended("Cancelled: nothing was computed.", ""))
        return job

    def reread(self) -> None:
        """The run's folder again (steps saved since), from the window's worker that opens runs."""
        if self.run is not None:
            self.w.open_path(self.run.location, as_run=True)

    def _idle(self, run: Any) -> None:
        if self.run is run:
            self.view.set_busy(False)

    def _progress(self, p: Any) -> None:
        if hasattr(p, "fraction"):
            self.view.progress.setValue(int(p.fraction * 1000))
            if getattr(p, "current", None):
                self.view.progress.setFormat(f"%p%  {printable(str(p.current))}")

    def _analysed(self, run: Any, report: Any, cells: Any) -> None:
        if self.run is not run:
            return  # another run was opened meanwhile
        self.report = report
        self.view.show_report(report, [s.name for s in run.steps], cells)
        self.view.choose_step(self.position if self.position is not None else len(run.steps) - 1)
        self._shade()
        self.selection_changed(self.w.selected_node())

    # -- names across the step's prefix -----------------------------------------------------------
    def _prefix(self, position: int | None) -> str:
        if self.run is None or position is None:
            return ""
        return str(self.run.steps[position].parts[0][0])

    def report_name(self, fqn: str) -> str:
        return self._prefix(self.position) + fqn

    def checkpoint_name(self, name: str) -> str | None:
        prefix = self._prefix(self.position)
        return name[len(prefix) :] if name.startswith(prefix) else None

    def step_location(self, position: int) -> Any:
        """What the window opens for the step at ``position``: its first part."""
        return self.run.steps[position].parts[0][1]

    # -- the window's hooks -----------------------------------------------------------------------
    def opened(self, ckpt: Checkpoint) -> None:
        """The window opened ``ckpt``: shade it if it is a step of the run, do what waited for it."""
        if self.run is None:
            return
        where = [i for i in range(len(self.run.steps)) if _same(self.step_location(i), ckpt.path)]
        if not where:
            return
        self.position = where[0]
        if self.view is not None:
            self.view.choose_step(self.position)
        self._shade()
        pending, self.pending = self.pending, None
        if pending is not None and _same(pending[0], ckpt.path):
            pending[1](ckpt)

    def add_recent(self, path: Path) -> None:
        """Remember ``path`` as opened lately, unless it is a step of the run shown (the run is)."""
        if self.run is None or not any(_same(self.step_location(i), path) for i in range(len(self.run.steps))):
            self.w.settings.add_recent(path)

    def selection_changed(self, node: Node | None) -> None:
        """Plot the entry selected in the tree (a tensor, or a group: its module's series)."""
        if self.view is None or self.report is None or node is None:
            return
        self.view.plot_entry(self.report_name(node.path))

    def _shade(self) -> None:
        model = self.w.tree_pane.model
        if self.report is None or self.position is None or model is None or self.view is None:
            return
        i, step = self.position, self.report.steps[self.position]
        changes: dict[str, float | None] = {}
        for name, series in self.report.series.items():
            fqn = self.checkpoint_name(name)
            if fqn is not None and "rel_change" in series:
                changes[fqn] = series["rel_change"][i]
        groups: dict[str, float | None] = {}
        for name, series in self.report.groups.items():
            fqn = self.checkpoint_name(name)
            if fqn and "rel_change" in series:
                groups[fqn] = series["rel_change"][i]
        scale = model.shade(changes, f"relative change at step {step}:", groups)
        self.view.legend.setText(
            f"Tree: relative change at step {step} — {scale.legend()}" if scale is not None and i > 0
            else f"Tree: step {step}, the first: nothing to compare it with"
        )  # fmt: skip

    # -- what the Run view asks for ---------------------------------------------------------------
    def _open_then(self, position: int, then: Callable[[Checkpoint], None]) -> Any:
        """Open the step at ``position`` in the window (unless it is open), then ``then(ckpt)``; the
        opening job, or None when the step was open already."""
        target = self.step_location(position)
        ckpt = self.w.ckpt
        if ckpt is not None and _same(ckpt.path, target):
            self.position = position
            self._shade()
            then(ckpt)
            return None
        self.pending = (str(target), then)
        self.w.open_path(target)
        return self.w.board.jobs.get("open")

    def choose_step(self, position: int) -> None:
        """Show the step at ``position`` in the tree (the entry plotted stays selected)."""
        keep = self.view.name

        def reselect(_ckpt: Checkpoint) -> None:
            fqn = self.checkpoint_name(keep) if keep else None
            if fqn:
                self.w.select(fqn)

        self._open_then(position, reselect)

    def compare(self, a: int, b: int, name: str) -> Any:
        """Compare the step at ``a`` (the window's checkpoint, A) with the one at ``b`` (B), focused on
        ``name`` (a tensor, or a module: the entries under it): only those are read, the entry is
        selected, and the Compare view offers Compare Everything. The outcome -- or why there is
        none -- is said here too."""
        b_location = self.step_location(b)
        steps = f"step {self.run.steps[a].step} with step {self.run.steps[b].step}"
        elsewhere = self._part_of(b, name)
        if elsewhere is not None:
            self.view.say(
                f"{name} is in the steps' {elsewhere}, which the window does not show: open it to compare it.", "error"
            )
            return None
        fqn = self.checkpoint_name(name) or name
        run = self.run

        def said(text: str, state: str = "") -> None:
            if self.run is run:
                self.view.say(text, state)

        def compare(_ckpt: Checkpoint) -> None:
            self.w.select(fqn)
            view = self.w.compare_view
            self.w.views.setCurrentWidget(view)
            job = view.run(Path(b_location) if isinstance(b_location, Path) else b_location, only=fqn)
            if job is None:  # refused (its tolerances): the Compare view's message says why
                said(f"Not compared ({steps} on {name}): see the Compare view.", "error")
                return
            job.result.connect(lambda _r: said(f"Compared {steps} on {name}: see Compare ({view.summary.text()})."))
            job.errored.connect(lambda e: said(f"Not compared ({steps} on {name}): {describe(e)}", "error"))
            job.cancelled.connect(lambda: said(f"Comparison of {steps} on {name} cancelled."))

        self.view.say(f"Comparing {steps} on {name}…")
        opening = self._open_then(a, compare)
        if opening is not None:

            def not_opened(e: BaseException) -> None:
                if self.pending is not None and self.pending[1] is compare:
                    self.pending = None  # not to compare when the step opens some other time
                said(f"Not compared: step {run.steps[a].step} did not open: {describe(e)}", "error")

            opening.errored.connect(not_opened)
        return opening

    def _part_of(self, position: int, name: str) -> str | None:
        """The file of the step at ``position`` holding report entry ``name`` when it is not the part
        the window opens (a Hugging Face Trainer folder's ``optimizer.pt``), else None."""
        for prefix, where, _fmt in self.run.steps[position].parts[1:]:
            if prefix and name.startswith(prefix):
                return str(getattr(where, "name", where))
        return None

    def select_entry(self, name: str) -> None:
        fqn = self.checkpoint_name(name)
        if fqn is None or not self.w.select(fqn):
            self.view.plot_entry(name)  # not in the tree shown (another step's layout): plotted anyway
