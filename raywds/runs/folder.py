"""A run's folder, written by rank 0 of local, torchrun and Ray runs alike:

RUN_DIR/metrics.jsonl   a row per finished epoch, per in-epoch checkpoint, and progress rows, each with its
                        "kind" (raywds.runs.rows)
RUN_DIR/config.json     the resolved config (raywds-config.json beside a Ray run's own files)
RUN_DIR/checkpoint.pt   the latest checkpoint (local runs; Ray keeps its own checkpoint folders)
RUN_DIR/best/           the checkpoint with the best validation top-1, and its metrics.json
RUN_DIR/tensorboard/    with --tensorboard: the rows' numbers as TensorBoard scalars (raywds.runs.tensorboard)
RUN_DIR/tracking.json   with --tracking mlflow or wandb: the tracking runs' ids, reused by what continues the run
RUN_DIR/wandb/          with --tracking wandb: W&B's own files (unless WANDB_DIR says elsewhere)
RUN_DIR/last-step       the step rank 0 trained last, written at every step

Nothing is written there until the run `start()`s, once every check that can refuse it has passed
(the data, the plan, the model, the resume checkpoint, the trackers: raywds.train.trainer):
a refused run leaves the folder as it found it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from raywds.runs import files, tracking
from raywds.runs.checkpoint import save_checkpoint
from raywds.runs.lock import RunLock
from raywds.runs.rows import kind, read_rows
from raywds.runs.tensorboard import TensorBoard
from raywds.runs.tracking import Trackers

log = logging.getLogger(__name__)

Metrics = dict[str, Any]


class Described(Protocol):
    """What a run folder needs of the config it records: the config by section, as written to
    config.json and sent to the trackers as parameters, and the trackers' names (its run section's,
    raywds.runs.recording.Recording.trackers); the training config is one."""

    def to_dict(self) -> dict[str, dict[str, Any]]: ...
    def trackers(self) -> list[str]: ...


def best_top1(row: Mapping[str, Any]) -> float:
    """What best/ is chosen by: the row's validation top-1, or its --model-ema average's where better
    (the checkpoint holds both weights)."""
    return max(float(row.get("val_top1", -1.0)), float(row.get("val_top1_ema", -1.0)))


def check_trackers(names: Sequence[str]) -> None:
    """Refuse, before the run starts, a tracker of `names` whose client does not import or whose
    server does not answer (raywds.runs.tracking.check)."""
    tracking.check(names)


class RunDir:
    """`append` keeps the metrics (and TensorBoard event files) of the run being resumed;
    otherwise metrics.jsonl starts empty, when the run starts. `config`: the name of the resolved
    config's file; `lock`: the folder's lock, told when the run starts."""

    def __init__(
        self, path: str | Path, *, append: bool = False, config: str = files.CONFIG, lock: RunLock | None = None
    ):
        self.path = Path(path)
        self.metrics_path = self.path / files.METRICS
        self.checkpoint_path = self.path / files.CHECKPOINT
        self.config_name, self.lock = config, lock
        self.trackers: Trackers | None = None
        self.continues = append
        self.started = False
        self._last_step: int | None = None
        """The open last-step file."""

    def start(self, cfg: Described | None = None, saved: dict[str, str] | None = None) -> None:
        """The first write, once nothing can refuse the run: the folder (made if missing), an empty
        metrics.jsonl and no last-step unless the run continues here, then the resolved config `cfg`
        and its trackers (continuing the tracking runs of `saved`, a checkpoint's ids)."""
        if self.started:
            return
        self.started = True
        if self.lock is not None:
            self.lock.start()
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.continues:
            self.metrics_path.write_text("")
            (self.path / files.LAST_STEP).unlink(missing_ok=True)
        if cfg is None:
            return
        self.write_config(cfg, self.config_name)
        if cfg.trackers():
            self.open_tracking(cfg.trackers(), cfg.to_dict(), saved)

    def _written(self) -> None:
        if not self.started:
            raise RuntimeError(f"run folder {self.path} written before its run started (RunDir.start)")

    def open_tracking(
        self, names: list[str], config: Mapping[str, Mapping[str, Any]], saved: dict[str, str] | None
    ) -> None:
        """Send each row from now on to the trackers in `names` (raywds.runs.tracking.TRACKERS),
        continuing the tracking runs of `saved` (a checkpoint's) or of this folder's tracking.json;
        TensorBoard keeps this folder's event files where the run continues here."""
        if names and self.trackers is None:
            self._written()
            self.trackers = Trackers.open(
                names, config, self.path, saved, name=self.name, files=self.tracker_files, append=self.continues
            )

    @property
    def events(self) -> TensorBoard | None:
        """The TensorBoard tracker, where the run has one."""
        return self.trackers.events if self.trackers is not None else None

    @property
    def name(self) -> str:
        """The run's name in trackers: its folder's."""
        return self.path.name

    @property
    def tracker_files(self) -> Path | None:
        """Where trackers keep files of their own (W&B's): in the run folder."""
        return self.path

    def tracking_ids(self) -> dict[str, str]:
        """The tracking runs' ids, for each checkpoint to keep."""
        return self.trackers.saved() if self.trackers is not None else {}

    def note(self, key: str, text: str) -> None:
        """A line of text for the trackers (the doctor's verdict): the latest one is kept."""
        if self.trackers is not None:
            self.trackers.note(key, text)

    def close(self, *, artifact: bool = False) -> None:
        """End the tracking runs (with best/checkpoint.pt as an artifact when asked), saying in a
        line each what could not be sent; close the TensorBoard writer, if open (every row is on
        disk already)."""
        if self.trackers is not None:
            best = self.path / files.BEST / files.CHECKPOINT if artifact else None
            for line in self.trackers.close(best=best):
                log.warning(f"tracking: {line}")
            self.trackers = None
        if self._last_step is not None:
            os.close(self._last_step)
            self._last_step = None

    def mark(self, step: int) -> None:
        """The step rank 0 has just trained: one small write in place, not synced (a lost node's
        page cache may lose the last few; a killed process's is kept)."""
        if self._last_step is None:
            self._written()
            self._last_step = os.open(self.path / files.LAST_STEP, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._last_step, f"{step:>20d}\n".encode(), 0)

    def last_step(self) -> int | None:
        """The step rank 0 marked last, in this run or the one it continues here (None: never marked)."""
        if not (self.continues or self.started):  # another run's, which start() removes
            return None
        try:
            return int((self.path / files.LAST_STEP).read_text())
        except (OSError, ValueError):
            return None

    def put_text(self, name: str, text: str) -> None:
        """A small file of the run's at `name` (a path inside the folder), whole or not at all."""
        self._written()
        path = self.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.part")
        part.write_text(text)
        part.replace(path)

    def get_text(self, name: str) -> str | None:
        """The file `put_text` put at `name`, in this or another process (None: not there yet)."""
        try:
            return (self.path / name).read_text()
        except FileNotFoundError:
            return None

    def validated(self) -> set[int]:
        """The epochs whose validation, done apart, this run folder holds a row of."""
        if not (self.continues or self.started) or not self.metrics_path.is_file():
            return set()
        return {int(row["epoch"]) for row in read_rows(self.metrics_path) if kind(row) == "validation"}

    def write_config(self, cfg: Described, name: str = files.CONFIG) -> Path:
        self._written()
        path = self.path / name
        path.write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
        return path

    def append(self, row: Mapping[str, Any]) -> None:
        """One row of metrics.jsonl (and its numbers in TensorBoard, when open)."""
        self._written()
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.trackers is not None:
            self.trackers.row(row)

    def record(self, metrics: Metrics, state: dict[str, Any]) -> None:
        """An epoch's (or an in-epoch checkpoint's) metrics, and best/ when top-1 improved."""
        self.append(metrics)
        self.keep_best(metrics, state)

    def save(self, metrics: Metrics, state: dict[str, Any] | None) -> None:
        """A local run's report: the metrics, the latest checkpoint and best/ (rank 0 passes `state`)."""
        if state is None:
            return
        self.append(metrics)
        save_checkpoint({**state, "tracking": self.tracking_ids()}, self.checkpoint_path)
        self.keep_best(metrics, state)

    def beats_best(self, metrics: Metrics) -> bool:
        """Whether `metrics` hold a validation top-1 better than best/'s (read from best/metrics.json,
        so it holds across restarts)."""
        if "val_top1" not in metrics:
            return False
        record = self.path / files.BEST_ROW
        return not (record.is_file() and best_top1(json.loads(record.read_text())) >= best_top1(metrics))

    def keep_best(self, metrics: Metrics, state: dict[str, Any]) -> bool:
        """Copy the checkpoint to best/ when its validation top-1 beats the one there; True when it did."""
        if not self.beats_best(metrics):
            return False
        self._written()
        best = self.path / files.BEST
        record = self.path / files.BEST_ROW
        best.mkdir(exist_ok=True)
        save_checkpoint(state, best / files.CHECKPOINT)
        record.write_text(json.dumps(metrics) + "\n")
        return True
