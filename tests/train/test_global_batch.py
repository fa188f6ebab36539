"""--global-batch (raywds.train.loop, raywds.train.epoch): the optimizer sees the same samples a
step on any number of ranks, by accumulating gradients; the epoch rows count its steps; a global
batch a world cannot reach is refused in one line."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.runs import small_config
from torch import nn

from raywds.errors import ConfigError
from raywds.launch.ray_train import check_global_batch
from raywds.models import sources
from raywds.runs.folder import RunDir
from raywds.runs.rows import read_rows
from raywds.train.config import TrainConfig
from raywds.train.trainer import train
from raywds.world import World

FORKSERVER = "forkserver"


def plain_net(num_classes: int) -> nn.Module:
    """A small network without BatchNorm: the mean gradient over 16 samples is then exactly the
    mean of two means over 8, whatever the batches' statistics."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes)
    )


class Plain(sources.ModelSource):
    """`--model plain`: `plain_net`, one more source in raywds's table."""

    name = "plain"

    def claims(self, text: str) -> bool:
        return text == "plain"

    def parse(self, text: str) -> sources.ModelName:
        return sources.ModelName(self, "plain")

    def names(self) -> list[str]:
        return ["plain"]

    def build(self, name: sources.ModelName, num_classes: int) -> nn.Module:
        return plain_net(num_classes)

    def has_weights(self, name: sources.ModelName) -> bool:
        return False


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows if r["kind"] == "progress"]


def test_two_batches_a_step_train_as_one_batch_of_both(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank: --batch-size 16 against --batch-size 8 --global-batch 16, the same sample stream:
    the same steps, the same losses (float rounding apart)."""
    monkeypatch.setattr(sources, "SOURCES", {"plain": Plain(), **sources.SOURCES})  # a model source of the test's
    base = small_config(shards, model="plain", mode="split", epochs=2, log_every=0.0, worker_shuffle_buffer=0)
    runs = {}
    for name, cfg in {
        "one batch": dataclasses.replace(base, batch_size=16),
        "two batches": dataclasses.replace(base, batch_size=8, global_batch=16),
    }.items():
        train(dataclasses.replace(cfg, out=str(tmp_path / name)), World(), run_dir=RunDir(tmp_path / name))
        runs[name] = read_rows(tmp_path / name / "metrics.jsonl")
    one = [r for r in runs["one batch"] if r["kind"] == "epoch"]
    two = [r for r in runs["two batches"] if r["kind"] == "epoch"]
    assert [r["optimizer_steps"] for r in one] == [r["optimizer_steps"] for r in two] == [8, 8]  # 120 samples / 16
    assert [r["step"] for r in two] == [15, 30], "`step` counts batches: two a step"
    assert [r["global_batch"] for r in one] == [r["global_batch"] for r in two] == [16, 16]
    for a, b in zip(one, two):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5), (a["train_loss"], b["train_loss"])
    assert one[-1]["train_loss"] < one[0]["train_loss"], "it learns"


def _rank(rank: int, cfg: TrainConfig, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        train(cfg, World(rank=rank, world_size=2), run_dir=RunDir(out) if rank == 0 else None)
    finally:
        dist.destroy_process_group()


LOSS_TOLERANCE = 0.15
"""Relative: each epoch's training loss on 2 ranks and on 1 rank accumulating 2 batches. The
demo network has BatchNorm, which sees one rank's batch of 16 either way; and the ranks' deal
gives each optimizer step other samples than the one rank's order does."""


@pytest.mark.slow
def test_the_same_global_batch_on_two_ranks_and_on_one_gives_the_same_curve(shards: Path, tmp_path: Path) -> None:
    cfg = small_config(shards, mode="split", epochs=3, batch_size=16, global_batch=32, log_every=0.0)
    two = tmp_path / "two"
    mp.start_processes(_rank, args=(dataclasses.replace(cfg, out=str(two)), str(tmp_path / "store"), str(two)),
                       nprocs=2, start_method=FORKSERVER)  # fmt: skip
    one = tmp_path / "one"
    train(dataclasses.replace(cfg, out=str(one)), World(), run_dir=RunDir(one))
    rows = {n: [r for r in read_rows(p / "metrics.jsonl") if r["kind"] == "epoch"] for n, p in (("2", two), ("1", one))}
    assert [r["optimizer_steps"] for r in rows["2"]] == [r["optimizer_steps"] for r in rows["1"]] == [4, 4, 4]
    assert [r["step"] for r in rows["1"]] == [8, 16, 24] and [r["step"] for r in rows["2"]] == [4, 8, 12]
    for a, b in zip(rows["2"], rows["1"]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=LOSS_TOLERANCE), json.dumps([a, b])[:400]


def test_a_global_batch_a_world_cannot_reach_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"--global-batch 48 must be a multiple of --batch-size 32"):
        TrainConfig(data="x", batch_size=32, global_batch=48)
    cfg = TrainConfig(data="x", batch_size=16, global_batch=64)
    assert [cfg.accumulation(w) for w in (1, 2, 4)] == [4, 2, 1]
    with pytest.raises(
        ConfigError, match=r"cannot be reached by 3 rank\(s\) of --batch-size 16: make it a multiple of 48"
    ):
        cfg.accumulation(3)
    check_global_batch(cfg, 1, 2)
    with pytest.raises(ConfigError, match=r"by 3 rank\(s\) .* \(--num-workers 2\.\.4\): make it a multiple of 192"):
        check_global_batch(cfg, 2, 4)
