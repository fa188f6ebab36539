"""metrics.jsonl's rows: every row a real run writes says its kind and holds exactly the keys of
that kind's definition (raywds.runs.rows), required and optional."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NotRequired, get_origin, get_type_hints

from support.runs import small_config

from raywds.runs.folder import RunDir
from raywds.runs.rows import CheckpointRow, EpochRow, ProgressRow, ValidationRow, epochs, read_rows, validation_row
from raywds.runs.tensorboard import scalars
from raywds.runs.tracker import numbers
from raywds.train.trainer import train
from raywds.world import World

DEFINITIONS: dict[str, Any] = {"epoch": EpochRow, "checkpoint": CheckpointRow, "progress": ProgressRow}


def keys(definition: Any) -> tuple[set[str], set[str]]:
    """A row definition's required and optional keys (its `NotRequired` ones: with postponed
    annotations, TypedDict's own __optional_keys__ does not see them on Python 3.11)."""
    hints = get_type_hints(definition, include_extras=True)
    optional = {name for name, hint in hints.items() if get_origin(hint) is NotRequired}
    return set(hints) - optional, optional


def test_a_runs_rows_each_say_their_kind_and_hold_its_keys(shards: Path, tmp_path: Path) -> None:
    cfg = small_config(shards, epochs=2, batches_per_epoch=3, log_every=0.0, checkpoint_every_steps=2, max_steps=4)
    train(cfg, World(), run_dir=RunDir(tmp_path))
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert {row["kind"] for row in rows} == {"epoch", "checkpoint", "progress"}
    for row in rows:
        required, optional = keys(DEFINITIONS[row["kind"]])
        assert required <= row.keys() <= required | optional, (row["kind"], sorted(row.keys() ^ required))
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == [1]
    assert [r["step"] for r in rows if r["kind"] == "checkpoint"] == [2, 4], "inside epoch 1 (3 steps), and the stop"


def test_a_validation_done_apart_lands_in_its_epochs_row_its_step_and_its_keys() -> None:
    """`raywds ray --async-validation` writes an epoch's validation as a row of its own, after later
    rows: readers see its numbers in that epoch's row (the last run of a repeated epoch's), the
    trackers get them at that epoch's samples seen and TensorBoard at that epoch, and the row holds
    exactly ValidationRow's keys."""
    first = {"kind": "epoch", "epoch": 1, "step": 8, "samples_seen": 120, "train_loss": 2.0}
    second = {"kind": "epoch", "epoch": 2, "step": 16, "samples_seen": 240, "train_loss": 1.5}
    again = {**second, "train_loss": 1.4}  # a restart trained epoch 2 again
    numbers_1 = {"val_top1": 0.5, "val_top5": 0.9, "val_loss": 1.9, "val_samples": 50, "val_top1_ema": 0.4}
    numbers_2 = {"val_top1": 0.7, "val_top5": 1.0, "val_loss": 1.2, "val_samples": 50}
    late = validation_row(first, numbers_1, 3.25)
    required, optional = keys(ValidationRow)
    assert required <= late.keys() <= required | optional
    rows = [first, second, late, again, validation_row(again, numbers_2, 1.0)]
    merged = epochs(rows)
    assert [(r["epoch"], r["train_loss"], r["val_top1"]) for r in merged] == [(1, 2.0, 0.5), (2, 1.4, 0.7)]
    assert merged[0]["val_top1_ema"] == 0.4 and "validation_s" not in merged[0]
    assert epochs([second, late]) == [second], "a validation of an epoch with no row adds none"
    step, logged = numbers(late) or (None, {})
    assert step == 120 and logged == {k: float(v) for k, v in numbers_1.items() if k != "val_samples"}, (
        "the numbers an epoch row gives the trackers"
    )
    assert sorted((tag, step) for tag, _, step in scalars(late)) == [
        ("epoch/val_loss", 1),
        ("epoch/val_top1", 1),
        ("epoch/val_top5", 1),
    ]
