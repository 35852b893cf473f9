"""Conversion: one button per target (each also a drop target), options that apply to every target,
progress and Cancel, the outcome in a scrolling report, and "Open result" / "Verify" with
tolerances. The layout never moves: controls are enabled and disabled, not shown and hidden."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from dcpstudio.core import ConversionResult, DiffReport, ExpansionError, convert
from dcpstudio.core.ops.convert.convert import parse_size
from dcpstudio.core.ops.mappings import MappingError
from dcpstudio.core.ops.report import human_bytes, plural
from dcpstudio.core.ops.verify import Verification, verify

from ..context import Context
from ..locations import Location, is_remote, location, name_of
from ..workers import Job
from .destinations import SUFFIX, suggest_destination
from .drop_button import DropButton
from .mapping_choice import MappingChoice, MappingRequest
from .outcome import HEIGHT, OutcomeBox
from .ranks_choice import RanksChoice

__all__ = ["SUFFIX", "TARGETS", "ConvertPanel", "DropButton", "suggest_destination"]

TARGETS = {"dcp": "→ DCP", "torch": "→ torch.save", "safetensors": "→ safetensors"}
REPORT_HEIGHT = HEIGHT
_KINDS = ("convert", "verify")
_CAST_TIP = "Cast floating-point tensors (every target format)"


def _same(a: object, b: object) -> bool:
    """Whether two locations are the same checkpoint (a URL is never a local path)."""
    if is_remote(a) or is_remote(b):
        return location(a) == location(b)
    return Path(a).resolve() == Path(b).resolve()  # type: ignore[arg-type]


def _tolerance(box: QLineEdit, name: str) -> float:
    text = box.text().strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number ≥ 0, such as 1e-3 (got {text!r})")
    return value


class ConvertPanel(QWidget):
    """``opened_result(path)`` asks the window to open a conversion's output."""

    open_requested = Signal(object)

    def __init__(self, ctx: Context, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.ctx = ctx
        self.choose_destination = self._ask_destination  # replaced by the window (and tests)
        self.last_result: ConversionResult | None = None
        self.last_diff: DiffReport | None = None
        self.last_mapping: MappingRequest | None = None  # what the last result was mapped with
        self.buttons: dict[str, DropButton] = {}
        row = QHBoxLayout()
        for n, (target, title) in enumerate(TARGETS.items(), start=1):
            b = DropButton(title)
            b.setToolTip(f"Convert the open checkpoint {title[2:]} (Ctrl+{n}), or drop a checkpoint here")
            b.clicked.connect(lambda _=False, t=target: self.convert(t))
            b.dropped.connect(lambda path, t=target: self.convert(t, path))
            self.buttons[target] = b
            row.addWidget(b)
        self.include = QLineEdit()
        self.include.setPlaceholderText("regex, e.g. ^model\\.")
        self.exclude = QLineEdit()
        self.exclude.setPlaceholderText("regex, e.g. ^optim\\.")
        self.dtype = QComboBox()
        self.dtype.addItems(["keep dtypes", "bf16", "fp16", "fp32"])
        self.dtype.setToolTip(_CAST_TIP)
        self.split = QLineEdit()
        self.split.setPlaceholderText("e.g. 5GB (empty: one file)")
        self.split.setToolTip("Split DCP data files / safetensors shards at this size (empty: one file)")
        form = QGridLayout()  # two fields a row: the panel stays short, the views above get the height
        for n, (title, field) in enumerate(
            (
                ("Include", self.include),
                ("Exclude", self.exclude),
                ("Cast floats", self.dtype),
                ("Split at", self.split),
            )
        ):
            form.addWidget(QLabel(title), n // 2, 2 * (n % 2))
            form.addWidget(field, n // 2, 2 * (n % 2) + 1)
        self.mapping = MappingChoice(ctx, self)
        self.mapping.changed.connect(self._mapping_changed)
        for column, field in enumerate((QLabel("Mapping"), self.mapping.choice, QLabel("Config"), self.mapping.row)):
            form.addWidget(field, 2, column)
        self.ranks = RanksChoice(self)
        form.addWidget(QLabel("Ranks"), 3, 0)
        form.addWidget(self.ranks.spin, 3, 1)
        form.setColumnStretch(1, 1)
        form.setColumnStretch(3, 1)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop the conversion or verification (Esc); nothing is left behind")
        self.cancel_button.clicked.connect(self.cancel)
        self.outcome = OutcomeBox()
        self.report = self.outcome.text
        self.open_button = QPushButton("Open result")
        self.open_button.clicked.connect(self.open_result)
        self.verify_button = QPushButton("Verify")
        self.verify_button.setToolTip("Compare the source and the result, value by value (Ctrl+Shift+V)")
        self.verify_button.clicked.connect(self.verify)
        self.rtol = QLineEdit()
        self.rtol.setPlaceholderText("0")
        self.rtol.setToolTip("rtol: values within atol + rtol·|result| count as equal")
        self.atol = QLineEdit()
        self.atol.setPlaceholderText("0")
        self.atol.setToolTip("atol: values within atol + rtol·|result| count as equal")
        for box in (self.rtol, self.atol):
            box.setMaximumWidth(70)
        progress_row = QHBoxLayout()
        progress_row.addWidget(self.progress, 1)
        progress_row.addWidget(self.cancel_button)
        outcome = QHBoxLayout()
        outcome.addWidget(self.open_button)
        outcome.addStretch(1)
        outcome.addWidget(QLabel("rtol"))
        outcome.addWidget(self.rtol)
        outcome.addWidget(QLabel("atol"))
        outcome.addWidget(self.atol)
        outcome.addWidget(self.verify_button)
        lay = QVBoxLayout(self)
        lay.addLayout(row)
        lay.addLayout(form)
        lay.addLayout(progress_row)
        lay.addWidget(self.ranks.bars)
        lay.addWidget(self.outcome)
        lay.addLayout(outcome)
        self.set_busy(False)

    # -- state ----------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return any(k in self.ctx.board.jobs and self.ctx.board.jobs[k].running for k in _KINDS)

    def set_busy(self, busy: bool, text: str = "") -> None:
        for b in self.buttons.values():
            b.setEnabled(not busy)
        self.cancel_button.setEnabled(busy)
        self.progress.setEnabled(busy)
        self.progress.setValue(0)
        self.progress.setFormat(text[-60:] if busy else "")
        has_result = self.last_result is not None
        self.open_button.setEnabled(not busy and has_result)
        self.verify_button.setEnabled(not busy and has_result)
        if busy:
            self.outcome.show_outcome(text)

    def set_progress(self, fraction: float, text: str) -> None:
        self.progress.setValue(int(fraction * 1000))
        self.progress.setFormat(f"{fraction * 100:.0f}%  {text[-48:]}")

    def reset(self) -> None:
        """Forget the last outcome (another checkpoint was opened)."""
        if self.busy:
            return
        self.last_result = self.last_diff = self.last_mapping = None
        self.report.clear()
        self.set_busy(False)

    def keep_for(self, path: object) -> None:
        """A checkpoint was opened: keep the outcome if it concerns ``path`` (its source or result)."""
        self.mapping.refresh()
        r = self.last_result
        if r is None or not (_same(path, r.src) or _same(path, r.dst)):
            self.reset()

    def _mapping_changed(self, active: bool) -> None:
        """A mapping says what is written: selection and cast do not apply (as the CLI refuses them)."""
        for field in (self.include, self.exclude, self.dtype):
            field.setEnabled(not active)
            tip = _CAST_TIP if field is self.dtype else ""
            field.setToolTip("Does not apply with a mapping: the mapping says what is written" if active else tip)

    def options(self, target: str) -> dict[str, object]:
        mapped = self.mapping.spec() is not None
        opts: dict[str, object] = {} if mapped else {
            "include": self.include.text() or None,
            "exclude": self.exclude.text() or None,
            "dtype": None if self.dtype.currentIndex() == 0 else self.dtype.currentText(),
        }  # fmt: skip
        split = self.split.text().strip() or None
        if split is not None:
            parse_size(split)  # a bad size is reported before anything starts
            if target == "safetensors":
                opts["max_shard_size"] = split
            elif target == "dcp" and not mapped:
                opts["max_file_size"] = split
            elif mapped:
                raise ValueError(f"Split at {split}: with a mapping, only safetensors shards split; clear the field")
            else:  # nothing silent: a torch.save checkpoint is one file
                raise ValueError(
                    f"Split at {split}: a torch.save checkpoint is one file; clear the field, or convert to DCP or "
                    "safetensors"
                )
        return opts

    # -- converting -----------------------------------------------------------------------------------
    def _ask_destination(self, target: str, src: Location) -> Path | None:
        suggestion = suggest_destination(target, src, self.ctx.settings.last_dir())
        what = TARGETS[target][2:] if target in TARGETS else "a Hugging Face folder"
        return self.ctx.save_path(f"Convert {name_of(src)} to {what}", suggestion, "")

    def convert(
        self, target: str, src: object = None, dst: object = None, *, allow_expansion: bool = False
    ) -> Job | None:
        """Convert ``src`` (default: the open checkpoint; a path or a URL) to ``target`` at ``dst``
        (default: asked). A remote destination is not asked about on the GUI thread: if something
        is there already, the conversion stops with "exists" and nothing is replaced. An output
        refused as many times larger than its source is written if the user confirms it."""
        ckpt = self.ctx.checkpoint()
        source: Any = location(src) if src is not None else (ckpt.path if ckpt is not None else None)
        if source is None:
            self.ctx.notifier.info("Open a checkpoint first, or drop one on a conversion button.")
            return None
        try:
            options = self.options(target)
            request = self.mapping.request()
        except ValueError as e:
            self._refused(e)
            return None
        refusal = self.mapping.refusal_for(source, request) if request is not None else None
        refusal = refusal or self.ranks.refusal(source)
        if refusal is not None:  # the preview showed it: said here, before a destination is asked
            self._refused(MappingError(refusal))
            return None
        mapped_hf = request is not None and target == "safetensors"  # a folder: shards + config.json
        chosen = dst or self.choose_destination("hf" if mapped_hf else target, source)
        if chosen is None:
            return None
        dst = location(chosen)
        if (
            isinstance(dst, Path)
            and not is_remote(source)
            and (_same(dst, source) or source.resolve() in dst.resolve().parents)
        ):
            self.ctx.notifier.info(
                f"Choose another destination: {dst.name} is the checkpoint being converted "
                "(the result is written beside it, then you may replace it)."
            )
            return None
        overwrite = False
        if isinstance(dst, Path) and (dst.exists() or dst.is_symlink()):
            if not self.ctx.confirm(f"{dst} exists. Replace it?"):
                return None
            overwrite = True
        self.last_result, self.last_mapping = None, request
        self.set_busy(True, f"Converting {name_of(source)} → {name_of(dst)}")

        def work(progress: Any, cancel: Any) -> ConversionResult:
            with warnings.catch_warnings():  # notes come back in the result and are shown in the report
                warnings.simplefilter("ignore", UserWarning)
                return convert(
                    source,
                    dst,
                    to=target,
                    progress=progress,
                    cancel=cancel,
                    overwrite=overwrite,
                    allow_expansion=allow_expansion,
                    **options,
                )

        fn = (
            work
            if request is None
            else request.convert_work(source, dst, target, overwrite, options.get("max_shard_size"))
        )
        self.ranks.reset()
        if self.ranks.count > 1:
            base = dict(to=target, overwrite=overwrite)
            fn = self.ranks.work(
                source,
                dst,
                dict(base, allow_expansion=allow_expansion, **options)
                if request is None
                else request.rank_options(base, options),
            )
        cast = options.get("dtype")
        job = self.ctx.start(
            "convert", fn, lambda r: self._converted(r, cast), lambda: self.set_busy(False), self._progress
        )
        job.cancelled.connect(lambda: self.report.setPlainText("Cancelled; nothing was written."))
        job.errored.connect(lambda e: self.outcome.show_outcome(f"Failed: {e}", "error"))
        if request is None:
            job.errored.connect(lambda e: self._expanded(e, target, source, dst))
        return job

    def _expanded(self, e: object, target: str, source: object, dst: object) -> None:
        """Ask whether to write an output refused as many times larger than its source, and do."""
        if not isinstance(e, ExpansionError):
            return
        question = (
            f"The result would hold {human_bytes(e.total)}, {e.total / max(e.stored, 1):.0f} times the "
            f"{human_bytes(e.stored)} {name_of(source)} stores: {e.views} entries view one storage "
            f"({e.name!r} is one), and {TARGETS[target][2:]} writes each of them out. Write it anyway?"
        )
        if self.ctx.confirm(question):
            self.convert(target, source, dst, allow_expansion=True)

    def _progress(self, p: Any) -> None:
        mean = self.ranks.show(p)  # a rank's, on its bar (and the mean on the panel's)
        self.set_progress(p.fraction if mean is None else mean, p.current if mean is None else "on ranks")

    def _converted(self, result: ConversionResult, cast: object) -> None:
        self.last_result = result
        self.outcome.show_outcome(
            f"Wrote {result.dst} ({result.target}): {plural(result.tensors, 'tensor')}, "
            f"{human_bytes(result.tensor_bytes)}"
            + (f", floating-point tensors cast to {cast}" if cast else "")
            + "."
            + "".join(f"\n{note}" for note in result.notes),
            "ok",
        )
        self.ctx.notifier.info(f"Converted to {result.dst}", [("Open result", self.open_result)])

    def open_result(self) -> None:
        if self.last_result is not None:
            target = self.last_result.dst
            if is_remote(target):
                self.open_requested.emit(location(target))
                return
            index = target / "model.safetensors.index.json"
            self.open_requested.emit(index if index.exists() else target)

    def _refused(self, e: Exception) -> None:
        """A request refused before it started: said in the panel, where it was made, and noted."""
        self.outcome.show_outcome(f"Not started: {e}", "error")
        self.ctx.notifier.error(e)

    def verify(self) -> Job | None:
        """Compare the last conversion's result with its source *through* the options it was written
        with (kept entries, cast, new names: :func:`dcpstudio.core.ops.verify.verify`)."""
        if self.last_result is None:
            self.ctx.notifier.info("Convert a checkpoint first: Verify compares its source and its result.")
            return None
        try:
            rtol, atol = _tolerance(self.rtol, "rtol"), _tolerance(self.atol, "atol")
        except ValueError as e:
            self._refused(e)
            return None
        if self.last_mapping is not None and (rtol or atol):
            self._refused(ValueError("rtol/atol do not apply with a mapping: it moves values, so they compare exactly"))
            return None
        a, b, transform = self.last_result.src, self.last_result.dst, self.last_result.transform
        self.set_busy(True, f"Verifying {name_of(a)} against {name_of(b)}")

        def work(progress: Any, cancel: Any) -> Verification:
            return verify(a, b, transform=transform, rtol=rtol, atol=atol, progress=progress, cancel=cancel)

        mapping = self.last_mapping  # through it: each tensor recomputed from the source
        fn = work if mapping is None else mapping.verify_work(a, b)

        def done(result: Verification) -> None:
            self.last_diff = result.report
            self.outcome.show_outcome(result.text(), "ok" if result.equal else "differ")

        job = self.ctx.start("verify", fn, done, lambda: self.set_busy(False), self._progress)
        job.cancelled.connect(lambda: self.report.setPlainText("Verification cancelled."))
        job.errored.connect(lambda e: self.outcome.show_outcome(f"Verification failed: {e}", "error"))
        return job

    def cancel(self) -> None:
        for kind in _KINDS:
            self.ctx.board.cancel(kind)
