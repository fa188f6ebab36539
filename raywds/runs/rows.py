"""The rows of a run's metrics.jsonl (raywds.runs.folder): one typed definition per kind, and
each row says its kind. Writers build their rows from these (mypy checks every key); readers ask
`kind(row)`.

    epoch       a finished epoch: loss, counts, rates, each rank's stage times, validation
    checkpoint  a checkpoint inside an epoch (or a run stopped there by --max-steps)
    progress    rank 0's view inside an epoch, every --log-every seconds
    validation  an epoch's validation, done apart from training (`raywds ray --async-validation`):
                its numbers belong to that epoch's row, which `epochs` merges them into
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

Kind = Literal["epoch", "checkpoint", "progress", "validation"]
KINDS: tuple[str, ...] = ("epoch", "checkpoint", "progress", "validation")


class EpochRow(TypedDict):
    kind: Literal["epoch"]
    epoch: int
    """From 1: the epochs done."""
    step: int
    """Steps done in the run, this epoch's included."""
    train_loss: float
    train_samples: int
    samples_seen: int
    bad_samples: int
    bad_samples_total: int
    bad_samples_distinct: int
    bad_samples_distinct_total: int
    bad_shards: int
    read_retries: int
    epoch_samples: int
    """Samples the ledger counted for the whole epoch (a resumed epoch's first segment included)."""
    epoch_distinct: int
    epoch_duplicates: int
    epoch_missing: int
    images_per_s: float
    images_per_s_per_rank: list[float]
    data_wait_per_rank: list[float]
    data_wait_max: float
    lr: float
    stages: dict[str, Any]
    """Each rank's stage times (raywds.runs.stagetimes), what the doctor reads."""
    optimizer_steps: int
    """The epoch's optimizer steps (its longest rank's): `step`'s batches, with --global-batch a
    step every global_batch / (ranks x --batch-size) of them."""
    global_batch: int
    """Samples an optimizer step saw (--global-batch, else ranks x --batch-size)."""
    image_size_px: int
    """The side of the training crops the model was given this epoch (--progressive-resize changes it)."""
    steps_redone: int
    """Steps trained again in this epoch after a restart: those past the checkpoint it resumed
    (0 when the checkpoint was taken on a notice, or nothing restarted)."""
    val_loss: NotRequired[float]
    val_top1: NotRequired[float]
    val_top5: NotRequired[float]
    val_samples: NotRequired[int]
    val_loss_ema: NotRequired[float]
    """--model-ema's average, validated on the same samples (raywds.train.ema)."""
    val_top1_ema: NotRequired[float]
    val_top5_ema: NotRequired[float]


class CheckpointRow(TypedDict):
    kind: Literal["checkpoint"]
    epoch: int
    """From 0: the epoch the checkpoint is inside."""
    step: int
    """Steps done in the run."""
    samples_seen: int
    inside_epoch: Literal[True]
    """What a reader checks for a run that stopped inside an epoch."""
    epoch_samples_done: NotRequired[int]
    """Samples of the epoch trained, on every rank (raywds train; the Lightning example leaves it out)."""
    reason: NotRequired[str]
    """A checkpoint taken on a notice: `preemption` (Ray's), `sigterm` or `sigint` (raywds.train.notice)."""
    deadline: NotRequired[float | None]
    """When the notice said the node or process goes (Unix seconds)."""
    nodes: NotRequired[list[str]]
    """The nodes the notice named."""


class ProgressRow(TypedDict):
    kind: Literal["progress"]
    time: float
    epoch: int
    """From 1: the epoch under way."""
    step: int
    step_in_epoch: int
    steps_in_epoch: int
    loss: float
    lr: float
    images_per_s_rank0: float
    data_wait_rank0: float
    eta_epoch_s: float
    doctor_rank0: str


VALIDATION_NUMBERS = ("val_loss", "val_top1", "val_top5", "val_samples", "val_loss_ema", "val_top1_ema", "val_top5_ema")
"""An epoch row's validation numbers (those of EpochRow's keys that start with val_)."""


class ValidationRow(TypedDict):
    kind: Literal["validation"]
    epoch: int
    """From 1: the epoch whose checkpoint was validated."""
    step: int
    samples_seen: int
    """The epoch row's: where the numbers go on a chart's x axis."""
    val_loss: float
    val_top1: float
    val_top5: float
    val_samples: int
    val_loss_ema: NotRequired[float]
    val_top1_ema: NotRequired[float]
    val_top5_ema: NotRequired[float]
    validation_s: float
    """How long the validation task took, its start and the checkpoint's loading included."""


def validation_row(epoch_row: Mapping[str, Any], numbers: Mapping[str, Any], seconds: float) -> dict[str, Any]:
    """The row for an epoch's validation done apart: `numbers` (val_top1, ...) of the checkpoint
    whose epoch row is `epoch_row`."""
    row = ValidationRow(
        kind="validation",
        epoch=int(epoch_row["epoch"]),
        step=int(epoch_row["step"]),
        samples_seen=int(epoch_row["samples_seen"]),
        val_loss=float(numbers["val_loss"]),
        val_top1=float(numbers["val_top1"]),
        val_top5=float(numbers["val_top5"]),
        val_samples=int(numbers["val_samples"]),
        validation_s=round(seconds, 3),
    )
    for key in ("val_loss_ema", "val_top1_ema", "val_top5_ema"):
        if key in numbers:
            row[key] = float(numbers[key])  # type: ignore[literal-required]  # one of ValidationRow's keys
    return {**row}


def checkpoint_row(epoch: int, step: int, samples_seen: int, epoch_samples_done: int) -> dict[str, Any]:
    """raywds train's row for a checkpoint inside epoch `epoch` (from 0)."""
    row = CheckpointRow(
        kind="checkpoint",
        epoch=epoch,
        step=step,
        samples_seen=samples_seen,
        inside_epoch=True,
        epoch_samples_done=epoch_samples_done,
    )
    return {**row}


def kind(row: Mapping[str, Any]) -> Kind:
    """The row's kind, as it says."""
    said = row["kind"]
    if said not in KINDS:
        raise ValueError(f"a metrics.jsonl row of kind {said!r}: not one of {', '.join(KINDS)}")
    return said  # type: ignore[no-any-return]  # checked against Kind's values just above


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of a metrics.jsonl, in the order written."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def epochs(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The finished epochs' rows, in epoch order, each with its validation's numbers where that was
    done apart (a validation row, written later); a resumed run may repeat an epoch: the last counts."""
    last: dict[int, dict[str, Any]] = {}
    for row in rows:
        if kind(row) == "epoch":
            last[row["epoch"]] = dict(row)
        elif kind(row) == "validation" and row["epoch"] in last:
            last[row["epoch"]].update({key: row[key] for key in VALIDATION_NUMBERS if key in row})
    return [last[e] for e in sorted(last)]
