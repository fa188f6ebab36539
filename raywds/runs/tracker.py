"""One tracker: a tool that a run's metrics.jsonl rows go to as they are written (MLflow, W&B,
TensorBoard; the table of them: raywds.runs.tracking.TRACKERS). A tracker takes each row, a note
(the doctor's verdict), the best checkpoint as an artifact, and the end; the ones with a server
send from a thread of their own (raywds.runs.sender), never from the training loop.

    class MyTool(Tracker):
        name, title, extra = "mytool", "My Tool", "mytool"
        @classmethod
        def start(cls, opening: Opening) -> MyTool: ...
        def send(self, step: int, values: dict[str, float]) -> None: ...
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from raywds.errors import ConfigError
from raywds.runs.rows import kind
from raywds.runs.sender import Sender

EPOCH_METRICS = (
    "train_loss", "val_loss", "val_top1", "val_top5", "lr", "images_per_s", "data_wait_max", "samples_seen",
    "epoch", "optimizer_steps", "global_batch", "steps_redone", "bad_samples", "epoch_duplicates", "epoch_missing",
    "val_loss_ema", "val_top1_ema", "val_top5_ema",
)  # fmt: skip
"""An epoch row's numbers that the trackers with a server get (the val_ ones on epochs that validated)."""
VALIDATION_METRICS = tuple(key for key in EPOCH_METRICS if key.startswith("val_"))
"""A validation row's (`raywds ray --async-validation`): the epoch row's val_ numbers, at its step."""
CHECKPOINT_METRICS = ("samples_seen", "epoch_samples_done")
"""An in-epoch checkpoint row's: how far the epoch is, at the checkpoint cadence."""


def numbers(row: Mapping[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(samples seen, the numbers to log) of a metrics.jsonl row (a validation row's at its epoch's
    samples seen, as in-loop validation logs them); None for a progress row (rank 0's look inside
    an epoch every --log-every seconds, for TensorBoard and the console)."""
    keys: tuple[str, ...]
    if kind(row) == "epoch":
        keys = EPOCH_METRICS
    elif kind(row) == "checkpoint":
        keys = CHECKPOINT_METRICS
    elif kind(row) == "validation":  # an epoch's validation done apart: at that epoch's step
        keys = VALIDATION_METRICS
    else:
        return None
    return int(row["samples_seen"]), {key: float(row[key]) for key in keys if isinstance(row.get(key), int | float)}


def missing(name: str, extra: str, e: ImportError) -> ConfigError:
    """The refusal of a tracker whose package does not import here."""
    return ConfigError(f"--tracking {name} needs the {extra} package, which does not import here ({e}): "
                       f"pip install 'raywds[{extra}]'")  # fmt: skip


@dataclass
class Opening:
    """What a tracker starts with: the run's tracking run id where one continues (a checkpoint's or
    tracking.json's), its config, its name in the tool, the run folder, where a tool keeps files of
    its own, the server found by the check before the run, and whether the folder's earlier files
    stay (a resumed or restarted run adds to them)."""

    run_id: str | None
    config: Mapping[str, Mapping[str, Any]]
    name: str
    folder: Path
    files: Path | None = None
    server: str | None = None
    append: bool = True
    sender: Sender | None = field(default=None, repr=False)


class Tracker:
    """A tool a run's rows go to. Subclasses say their name (what --tracking takes), title, the
    raywds extra their client comes in, where their server is set and what a refused run can do."""

    name: ClassVar[str]
    title: ClassVar[str]
    extra: ClassVar[str]
    """The raywds extra that brings the tool's client."""
    setting: ClassVar[str | None] = None
    """Where the tool's server is set (an environment variable)."""
    fixes: ClassVar[tuple[str, ...]] = ()
    """What a user can do when the server does not answer."""

    sends: ClassVar[bool] = True
    """Whether the tool's calls go to a server, from a thread of their own (False: it writes files)."""
    sender: Sender | None = None
    """That thread, once started."""

    def __init__(self) -> None:
        self.started = threading.Event()
        """Set once the tool's run exists (MLflow makes its id on its server)."""

    @classmethod
    def server(cls) -> str | None:
        """Where the tool's server is (None: nothing to reach); ConfigError where its client does not import."""
        return None

    @classmethod
    def unanswered(cls, url: str) -> str | None:
        """Why the server at `url` gives no answer in time; None when it answers."""
        return None

    @classmethod
    def client_env(cls) -> contextlib.AbstractContextManager[None]:
        """The settings the tool's client needs while the run sends (none by default)."""
        return contextlib.nullcontext()

    @classmethod
    def start(cls, opening: Opening) -> Tracker:
        """The tool's run for `opening`, being started (by its sender, where it has one)."""
        raise NotImplementedError

    def row(self, row: Mapping[str, Any]) -> None:
        """One metrics.jsonl row: its numbers to the tool (`numbers`), at its samples seen."""
        got = numbers(row)
        if got is not None:
            self.send(*got)

    def send(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def note(self, key: str, text: str) -> None:
        """A line of text (the doctor's verdict); the latest one is kept."""

    def artifact(self, path: Path) -> None:
        """The best checkpoint, at the end, where asked."""

    def end(self, status: str) -> None:
        """The run's end: FINISHED, FAILED or KILLED."""

    def saved(self) -> str | None:
        """The tool's run id, which a checkpoint keeps for what continues the run (None: none)."""
        return None

    def left(self, status: str) -> dict[str, Any] | None:
        """What tracking.json keeps of a run the end could not end (None: nothing to end later)."""
        return None

    def continues(self, left: Mapping[str, Any] | None) -> bool:
        """True when this is the run that `left` (a NOT_ENDED entry) says was left running."""
        return False


__all__ = ["CHECKPOINT_METRICS", "EPOCH_METRICS", "Opening", "Tracker", "missing", "numbers"]
