"""metrics.jsonl's rows: every row a real run writes says its kind and holds exactly the keys of
that kind's definition (raywds.runs.rows), and the readers (report, the notebook's progress
bar, TensorBoard) read a file written before rows carried a kind as they read a new one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.runs import small_config

from raywds.runs.folder import RunDir
from raywds.runs.follow import RunProgress
from raywds.runs.report import read_epochs
from raywds.runs.rows import CheckpointRow, EpochRow, ProgressRow, epochs, kind, read_rows
from raywds.runs.tensorboard import scalars
from raywds.train.trainer import train
from raywds.world import World

DEFINITIONS: dict[str, Any] = {"epoch": EpochRow, "checkpoint": CheckpointRow, "progress": ProgressRow}


def test_a_runs_rows_each_say_their_kind_and_hold_its_keys(shards: Path, tmp_path: Path) -> None:
    cfg = small_config(shards, epochs=2, batches_per_epoch=3, log_every=0.0, checkpoint_every_steps=2, max_steps=4)
    train(cfg, World(), run_dir=RunDir(tmp_path))
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert {row["kind"] for row in rows} == {"epoch", "checkpoint", "progress"}
    for row in rows:
        required, optional = DEFINITIONS[row["kind"]].__required_keys__, DEFINITIONS[row["kind"]].__optional_keys__
        assert required <= row.keys() <= required | optional, (row["kind"], sorted(row.keys() ^ required))
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == [1]
    assert [r["step"] for r in rows if r["kind"] == "checkpoint"] == [2, 4], "inside epoch 1 (3 steps), and the stop"


OLD = [  # rows as raywds wrote them before rows had a kind: told apart by their keys
    {"kind": "progress", "epoch": 1, "step": 2, "step_in_epoch": 2, "steps_in_epoch": 4, "loss": 2.0, "lr": 0.1,
     "images_per_s_rank0": 50.0, "data_wait_rank0": 0.1},
    {"epoch": 1, "step": 4, "train_loss": 1.9, "images_per_s": 100.0, "samples_seen": 64, "val_top1": 0.3},
    {"epoch": 1, "step": 6, "samples_seen": 96, "epoch_samples_done": 32, "inside_epoch": True},
    {"epoch": 2, "step": 8, "train_loss": 1.5, "images_per_s": 110.0, "samples_seen": 128, "val_top1": 0.5},
    {"epoch": 2, "step": 8, "train_loss": 1.4, "images_per_s": 120.0, "samples_seen": 128, "val_top1": 0.6},
]  # fmt: skip


def test_a_file_written_before_rows_had_a_kind_still_reads(tmp_path: Path) -> None:
    assert [kind(row) for row in OLD] == ["progress", "epoch", "checkpoint", "epoch", "epoch"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in OLD))
    finished = read_epochs(tmp_path)
    assert [(r["epoch"], r["train_loss"]) for r in finished] == [(1, 1.9), (2, 1.4)], "a repeated epoch: the last"
    assert finished == epochs(OLD)
    follower = RunProgress()
    for row in OLD[:3]:
        follower.add(row)
    assert follower.steps == 6, "the in-epoch checkpoint's step counts the whole run"
    charted = {tag for row in OLD for tag, _, _ in scalars(row)}
    assert {"progress/loss", "epoch/train_loss", "epoch/val_top1"} <= charted
    assert not list(scalars(OLD[2])), "an in-epoch checkpoint has nothing to chart"
