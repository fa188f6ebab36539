"""metrics.jsonl's rows: every row a real run writes says its kind and holds exactly the keys of
that kind's definition (raywds.runs.rows), required and optional."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NotRequired, get_origin, get_type_hints

from support.runs import small_config

from raywds.runs.folder import RunDir
from raywds.runs.rows import CheckpointRow, EpochRow, ProgressRow, read_rows
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
