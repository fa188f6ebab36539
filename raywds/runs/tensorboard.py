"""TensorBoard event files beside metrics.jsonl (`--tensorboard`): rank 0 writes the numbers of
each row to RUN_DIR/tensorboard/ through torch's SummaryWriter, for local, torchrun and Ray
runs alike: one of the trackers (raywds.runs.tracking.TRACKERS), the one that writes files, not
to a server.

    raywds train --demo --tensorboard
    tensorboard --logdir runs/demo/tensorboard

An epoch row gives `epoch/KEY` at step = the epoch (1, 2, ...), KEY its metrics.jsonl key, and
a per-rank list one scalar per rank (`epoch/data_wait_per_rank/rank1`), and where each rank's
epoch went as fractions of it (`epoch/step_time/compute/rank1`, raywds.train.doctor); a progress row gives
`progress/KEY` at its global step. The tensorboard package is imported only when a run asks
for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from raywds.errors import ConfigError
from raywds.runs import files
from raywds.runs.rows import kind
from raywds.runs.stagetimes import shares
from raywds.runs.tracker import Opening, Tracker

"""The event files' folder in the run folder."""
EVENT_FILES = "events.out.tfevents."
"""How every event file's name starts (TensorBoard's own naming)."""
EPOCH_SCALARS = ("train_loss", "val_loss", "val_top1", "val_top5", "lr", "images_per_s", "data_wait_max")
"""An epoch row's charts (the val_ ones only on epochs that validated)."""
EPOCH_PER_RANK = ("images_per_s_per_rank", "data_wait_per_rank")
"""An epoch row's lists, one value per rank."""
PROGRESS_SCALARS = ("loss", "lr", "images_per_s_rank0", "data_wait_rank0")
"""A progress row's charts (rank 0's view inside an epoch, raywds.train.progress)."""


def scalars(row: Mapping[str, Any]) -> Iterator[tuple[str, float, int]]:
    """(tag, value, step) for the numbers of one metrics.jsonl row: an epoch row's (or its
    validation's, done apart) at its epoch, a progress row's at its global step; an in-epoch
    checkpoint's row has none to chart."""
    if kind(row) == "progress":
        for key in PROGRESS_SCALARS:
            yield f"progress/{key}", row[key], row["step"]
    elif kind(row) == "validation":  # an epoch's validation done apart: its charts at its epoch
        for key in EPOCH_SCALARS:
            if key in row:
                yield f"epoch/{key}", row[key], row["epoch"]
    elif kind(row) == "epoch":
        for key in EPOCH_SCALARS:
            if key in row:
                yield f"epoch/{key}", row[key], row["epoch"]
        for key in EPOCH_PER_RANK:
            for rank, value in enumerate(row.get(key, [])):
                yield f"epoch/{key}/rank{rank}", value, row["epoch"]
        for part, values in (shares(row["stages"]) if "stages" in row else {}).items():
            for rank, value in enumerate(values):
                yield f"epoch/step_time/{part.replace(' ', '_')}/rank{rank}", value, row["epoch"]


def summary_writer() -> Any:
    """torch's SummaryWriter class, or the ConfigError that says how to install it (called before
    a run starts, so that a run without the package is refused before it writes)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"--tensorboard needs the tensorboard package, which does not import here ({e}): "
            "pip install 'raywds[tensorboard]', or leave out --tensorboard"
        ) from None
    return SummaryWriter


class EventWriter:
    """A new event file in `folder`. `append` keeps the event files already there (a resumed or
    restarted run adds its own; TensorBoard reads them together); otherwise they are removed,
    as metrics.jsonl starts empty.

    SummaryWriter writes from a thread of its own, alive when the DataLoader forks its workers;
    that thread takes no lock but its queue's and its file's, which no worker touches."""

    def __init__(self, folder: Path, *, append: bool):
        writer = summary_writer()
        if not append:
            for earlier in folder.glob(f"{EVENT_FILES}*"):
                earlier.unlink()
        self.folder = folder
        self.writer = writer(str(folder))

    def write(self, row: Mapping[str, Any]) -> None:
        for tag, value, step in scalars(row):
            self.writer.add_scalar(tag, value, step)
        # On disk before append returns, whatever file layer tensorboard uses (TensorFlow's, where
        # installed, buffers): a Ray worker is ended without closing its writer. Rows come once
        # an epoch or every --log-every seconds, so the wait is short.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class TensorBoard(Tracker):
    """`--tracking tensorboard` (or `--tensorboard`): each row's scalars into RUN_DIR/tensorboard/
    as the row is written, progress rows too; nothing to reach, no thread."""

    name, title, extra = "tensorboard", "TensorBoard", "tensorboard"
    sends = False

    def __init__(self, events: EventWriter):
        super().__init__()
        self.events, self.folder = events, events.folder
        self.started.set()

    @classmethod
    def server(cls) -> str | None:
        summary_writer()  # refuses a run without the package before it writes
        return None

    @classmethod
    def start(cls, opening: Opening) -> TensorBoard:
        return cls(EventWriter(opening.folder / files.TENSORBOARD, append=opening.append))

    def row(self, row: Mapping[str, Any]) -> None:
        self.events.write(row)

    def end(self, status: str) -> None:
        self.events.close()
