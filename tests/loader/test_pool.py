"""Loader workers that live for the whole run (raywds.loader.pool): the same processes make every
epoch, each epoch the batches a fresh loader makes, the pool resized by the difference, a dead
worker replaced alone, and the trainer handing the next epoch over before it validates."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from support.runs import small_config

from raywds.data.manifest import Manifest, read_manifest
from raywds.loader.loader import EpochLoader, PerRank, train_loader, val_loader
from raywds.loader.pool import Pool
from raywds.loader.settings import LoaderConfig
from raywds.loader.stages import Batch
from raywds.plan.epoch import EpochPlan
from raywds.plan.modes import epoch_plan
from raywds.plan.position import Position
from raywds.train.config import TrainConfig
from raywds.train.trainer import train
from raywds.world import World


def config(shards: Path, **overrides: object) -> TrainConfig:
    values = {"mode": "split", "batch_size": 8, "image_size": 24, "loader_workers": 2, **overrides}
    return small_config(shards, **values)


def summary(batches: Iterable[Batch]) -> list[tuple[list[int], int]]:
    """Each batch's sample ids, in order, and its pixels' sum: two epochs alike in both are alike."""
    return [(b.ids.tolist(), int(b.images.to(torch.int64).sum())) for b in batches]


def gone(pid: int | None, within_s: float = 10.0) -> bool:
    """`pid` has ended (a zombie not yet reaped counts) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if pid is None or Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_the_workers_outlive_the_epochs_and_each_epoch_is_the_one_a_fresh_loader_makes(shards: Path) -> None:
    cfg = config(shards)
    manifest, loader_cfg = read_manifest(str(shards)), cfg.loader()
    loaders, pids = PerRank(), []
    try:
        for n in range(3):
            plan = epoch_plan(manifest, cfg, 1, epoch=n)
            kept = summary(loaders.train(manifest, loader_cfg, World(), plan, epoch=n))
            pids.append(loaders.pools["train"].pids)
            fresh = summary(train_loader(manifest, loader_cfg, World(), plan, epoch=n))
            assert kept == fresh, f"epoch {n + 1}: the pool's batches differ from a fresh loader's"
            ids = Counter(i for batch_ids, _ in kept for i in batch_ids)
            assert sorted(ids) == list(range(manifest.num_samples("train"))) and set(ids.values()) == {1}
            assert summary(loaders.val(manifest, loader_cfg, World())) == summary(
                val_loader(manifest, loader_cfg, World())
            )
        assert all(p is not None for p in pids[0]) and len(pids[0]) == 2
        assert pids == [pids[0]] * 3, f"an epoch started its workers again: {pids}"
        val_pids = loaders.pools["val"].pids
    finally:
        loaders.close()
    assert all(gone(pid) for pid in pids[0] + val_pids), "close() stops every worker"


def test_a_resized_pool_starts_or_stops_only_the_difference() -> None:
    pool = Pool(World(), timeout=60)
    try:
        pool.warm(2)
        two = pool.pids
        pool.warm(3)
        three = pool.pids
        assert three[:2] == two and three[2] not in two
        pool.warm(1)
        assert pool.pids == two[:1]
        assert gone(three[1]) and gone(three[2]), "the workers no longer needed are stopped"
    finally:
        started = time.monotonic()
        pool.close()
        took = time.monotonic() - started
    assert took < 3, f"a waiting worker stops at once, not after torch's 5 s join ({took:.1f} s)"


def test_a_worker_that_died_between_epochs_is_replaced_alone(shards: Path) -> None:
    cfg = config(shards)
    manifest, loader_cfg = read_manifest(str(shards)), cfg.loader()
    loaders = PerRank()
    try:
        plans = [epoch_plan(manifest, cfg, 1, epoch=n) for n in range(2)]
        list(loaders.train(manifest, loader_cfg, World(), plans[0], epoch=0))
        pool = loaders.pools["train"]
        first, dead = pool.pids
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        assert gone(dead), "the worker was killed"
        time.sleep(0.5)  # torch's SIGCHLD handler, were it set, would raise here or in the next epoch
        kept = summary(loaders.train(manifest, loader_cfg, World(), plans[1], epoch=1))
        assert kept == summary(train_loader(manifest, loader_cfg, World(), plans[1], epoch=1))
        assert pool.replaced == 1 and pool.pids[0] == first and pool.pids[1] not in (None, dead)
    finally:
        loaders.close()


class Spy(PerRank):
    """The run's loaders, noting each call and the pools' workers at it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.pids: list[list[int | None]] = []

    def train(
        self,
        manifest: Manifest,
        cfg: LoaderConfig,
        world: World,
        plan: EpochPlan,
        *,
        epoch: int,
        position: Position | None = None,
    ) -> EpochLoader:
        loader = super().train(manifest, cfg, world, plan, epoch=epoch, position=position)
        self.calls.append(f"train {epoch + 1}")
        self.pids.append(self.pools["train"].pids + self.pools["val"].pids)
        return loader

    def val(self, manifest: Manifest, cfg: LoaderConfig, world: World) -> Iterable[Batch]:
        self.calls.append("val")
        return super().val(manifest, cfg, world)


def test_a_run_starts_its_workers_once_and_hands_the_next_epoch_over_before_validating(
    shards: Path, tmp_path: Path
) -> None:
    spy = Spy()
    metrics = train(config(shards, epochs=3, out=str(tmp_path)), World(), loaders=spy)
    assert metrics["epoch"] == 3 and metrics["epoch_missing"] == 0 and metrics["epoch_duplicates"] == 0
    assert spy.calls == ["train 1", "train 2", "val", "train 3", "val", "val"]
    assert len(spy.pids[0]) == 4 and None not in spy.pids[0], "2 training and 2 validation workers, started"
    assert spy.pids == [spy.pids[0]] * 3, f"an epoch started workers again: {spy.pids}"
    assert spy.pools == {}, "the run stops its workers at its end"
    assert all(gone(pid) for pid in spy.pids[0])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_pool_of_no_workers_or_one_makes_the_same_epoch(shards: Path, workers: int) -> None:
    cfg = config(shards, loader_workers=workers)
    manifest, loader_cfg = read_manifest(str(shards)), cfg.loader()
    plan = epoch_plan(manifest, cfg, 1, epoch=0)
    loaders = PerRank()
    try:
        kept = summary(loaders.train(manifest, loader_cfg, World(), plan, epoch=0))
    finally:
        loaders.close()
    assert kept == summary(train_loader(manifest, loader_cfg, World(), plan, epoch=0))


KEEPS_A_POOL = """
import sys, time
sys.path.insert(0, sys.argv[2])
from support.runs import small_config
from raywds.data.manifest import read_manifest
from raywds.loader.loader import PerRank
from raywds.loader.settings import LoaderConfig
from raywds.plan.modes import epoch_plan
from raywds.world import World

cfg = small_config(sys.argv[1], batch_size=8, image_size=24, loader_workers=2)
manifest, loaders = read_manifest(sys.argv[1]), PerRank()
list(loaders.train(manifest, cfg.loader(), World(), epoch_plan(manifest, cfg, 1, epoch=0), epoch=0))
print(*loaders.pools["train"].pids, *loaders.pools["val"].pids, flush=True)  # val's are warmed by now
time.sleep(600)
"""


@pytest.mark.slow
def test_the_workers_of_a_killed_rank_do_not_outlive_it(shards: Path) -> None:
    """A rank SIGKILLed between epochs (a lost node's process, the OOM killer) leaves its waiting
    loader workers behind it: they held the pipe's other end too, so they waited for ever (a
    killed test run's workers were found sleeping 39 minutes later). Now each ends within seconds."""
    import subprocess
    import sys

    tests = str(Path(__file__).parents[1])
    rank = subprocess.Popen([sys.executable, "-c", KEEPS_A_POOL, str(shards), tests], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert rank.stdout is not None
        pids = [int(p) for p in rank.stdout.readline().split()]
        assert len(pids) == 4 and all(not gone(p, within_s=0.2) for p in pids), "the workers wait for the next epoch"
        rank.kill()
        rank.wait()
        assert all(gone(p, within_s=15) for p in pids), "a killed rank's loader workers must end"
    finally:
        rank.kill()
        for pid in pids:  # this test's own workers, should they have stayed
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
