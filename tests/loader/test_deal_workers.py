"""The deal of shards to a rank's loader workers (raywds.loader.loader, raywds.loader.stages), on
real shards read by real DataLoader workers: in split mode each worker reads its slot of the plan,
in order, and after a resume only what the epoch has not delivered; in resample mode each worker
reads its own draws, the same the mode's stream makes; validation deals the split in manifest
order, each rank its own slots; a worker beyond the slots dealt is an error naming it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.runs import small_config
from torch.utils.data import DataLoader, IterableDataset

from raywds.data.manifest import deal, read_manifest
from raywds.errors import ConfigError
from raywds.loader.loader import drawn, split_slots, train_stages
from raywds.loader.settings import LoaderConfig
from raywds.loader.stages import unconsumed, worker_urls
from raywds.plan.modes import epoch_plan
from raywds.plan.position import Position
from raywds.plan.resample import PREFETCH, Resample
from raywds.plan.split import Split


class Stages(IterableDataset):
    """A loader worker running `stages` as the loader's workers do; it yields what it read, by worker."""

    def __init__(self, stages: list[Any]):
        self.stages = stages

    def __iter__(self) -> Iterator[tuple[str, int]]:
        import torch.utils.data

        worker = torch.utils.data.get_worker_info()
        samples = self.stages[0]()
        for stage in self.stages[1:]:
            samples = stage(samples)
        for sample in samples:
            yield worker.id if worker is not None else -1, sample["__url__"].rsplit("/", 1)[-1], int(sample["__id__"])


def read_by_workers(stages: list[Any], workers: int) -> dict[int, list[tuple[str, int]]]:
    """What each of `workers` real DataLoader workers reads through `stages`: (shard, sample id)s in order."""
    out: dict[int, list[tuple[str, int]]] = {w: [] for w in range(workers)}
    loader = DataLoader(Stages(stages), batch_size=None, num_workers=workers, multiprocessing_context="fork")
    for worker, shard, sample in loader:
        out[int(worker)].append((shard, int(sample)))
    return out


def shards_read(read: list[tuple[str, int]]) -> list[str]:
    return list(dict.fromkeys(shard for shard, _ in read))


def loader_cfg(shards: Path, **overrides: object) -> LoaderConfig:
    cfg = small_config(shards, **{"loader_workers": 2, "worker_shuffle_buffer": 0, **overrides})
    return cfg.loader()


def test_split_workers_read_their_slots_in_order_and_every_sample_once(shards: Path) -> None:
    manifest, cfg = read_manifest(str(shards)), loader_cfg(shards, mode="split")
    plan = Split().plan(manifest.shards("train"), num_ranks=2, num_workers=2, batch_size=8, seed=3, epoch=1)
    every: list[int] = []
    for rank in range(2):
        stages, _, _ = train_stages(manifest, cfg, rank, plan, epoch=1)
        read = read_by_workers(stages, 2)
        for worker in range(2):
            assert shards_read(read[worker]) == [s.name for s in plan.slot(rank, worker)]
            every += [sample for _, sample in read[worker]]
    assert sorted(every) == list(range(manifest.num_samples("train")))


def test_a_resumed_split_epoch_leaves_out_what_it_delivered(shards: Path) -> None:
    manifest, cfg = read_manifest(str(shards)), loader_cfg(shards, mode="split")
    train = manifest.shards("train")
    consumed = np.zeros(manifest.num_samples("train"), dtype=bool)
    consumed[:16] = True  # the first shard whole
    consumed[[16, 18, 20, 40]] = True  # some of the second and third
    here = Position.of_flags(consumed, train, mode=Split(), epoch=0, step=2, samples_done=20, dataset="")
    plan = epoch_plan(manifest, small_config(shards, mode="split", loader_workers=2), 1, epoch=0, done=here.done())
    stages, _, _ = train_stages(manifest, cfg, 0, plan, epoch=0, position=here)
    read = read_by_workers(stages, 2)
    got = sorted(sample for worker in read.values() for _, sample in worker)
    assert got == np.flatnonzero(~consumed).tolist()
    assert train[0].name not in {shard for worker in read.values() for shard, _ in worker}
    elsewhere, _, _ = train_stages(manifest, cfg, 0, plan, epoch=1, position=here)  # another epoch: all of it
    whole = {s.name: s.num_samples for s in train}
    assert len([s for w in read_by_workers(elsewhere, 2).values() for s in w]) == sum(
        whole[s.name] for w in range(2) for s in plan.slot(0, w)
    )


def test_resample_workers_read_their_own_draws(shards: Path, uneven: Path) -> None:
    smallest = read_manifest(str(uneven)).shards("train")  # 1 to 30 samples a shard
    cfg = loader_cfg(uneven, mode="resample", batch_size=4, worker_shuffle_buffer=5, cross_worker_shuffle_buffer=8)
    plan = Resample().plan(smallest, num_ranks=2, num_workers=2, batch_size=4)
    per_worker = (math.ceil(plan.max_batches / 2) + PREFETCH + 1) * 4 + 5 + 8  # its share, read ahead, the buffers
    assert [len(d) for d in drawn(plan, smallest, cfg, 0, epoch=0)] == [3 * per_worker + 8] * 2  # shards of 1
    assert drawn(plan, smallest, cfg, 0, epoch=0) == drawn(plan, smallest, cfg, 0, epoch=0, reseed=0)

    manifest = read_manifest(str(shards))
    cfg = loader_cfg(shards, mode="resample", batch_size=4, cross_worker_shuffle_buffer=3)
    train = manifest.shards("train")
    plan = Resample().plan(train, num_ranks=2, num_workers=2, batch_size=4)
    assert plan.max_batches == 15
    per_worker = (math.ceil(15 / 2) + PREFETCH + 1) * 4 + 3  # its share, read ahead, the shuffle buffers
    count = 3 * math.ceil(per_worker / 8) + 8  # three times over, in the smallest shards (8 samples)
    for rank, reseed in [(1, 0), (0, 40)]:
        draws = drawn(plan, train, cfg, rank, epoch=2, reseed=reseed)
        assert len(draws) == 2 and [len(d) for d in draws] == [count, count]
        for worker in range(2):
            stream = Resample().shards_for(plan, train, rank=rank, worker=worker, seed=cfg.seed, epoch=2, reseed=reseed)
            assert draws[worker] == [next(stream) for _ in range(count)]
        assert draws[0] != draws[1] != drawn(plan, train, cfg, rank, epoch=3, reseed=reseed)[1]
    position = Position(mode=Resample(), epoch=2, step=3, samples_done=40, shards_done=None, dataset="")
    stages, _, _ = train_stages(manifest, cfg, 0, plan, epoch=2, position=position)
    read = read_by_workers(stages, 2)
    for worker in range(2):
        expected = [s.name for s in drawn(plan, train, cfg, 0, epoch=2, reseed=40)[worker]]
        assert [shard for shard, _ in read[worker]][:100] == [
            name
            for name in expected
            for _ in range(manifest.shards("train")[manifest.index("train")[name]].num_samples)
        ][:100]


def test_validation_deals_the_split_in_manifest_order(shards: Path) -> None:
    manifest = read_manifest(str(shards))
    slots = split_slots(manifest, "val", 3)
    assert slots == deal(list(manifest.shards("val")), 3) and sum(map(len, slots)) == len(manifest.shards("val"))
    assert [s.name for slot in split_slots(manifest, "val", 1) for s in slot] == sorted(
        s.name for s in manifest.shards("val")
    )


def test_validation_ranks_read_their_own_slots(shards: Path) -> None:
    from raywds.loader.loader import val_loader
    from raywds.world import World

    manifest = read_manifest(str(shards))
    cfg = dataclasses.replace(loader_cfg(shards), loader_workers=0)
    slots = split_slots(manifest, "val", 2)
    keys: dict[int, int] = {}
    for rank in range(2):
        batches = list(val_loader(manifest, cfg, World(rank=rank, world_size=2)))
        keys[rank] = sum(len(b.labels) for b in batches)
        assert keys[rank] == sum(s.num_samples for s in slots[rank])
    assert sum(keys.values()) == manifest.num_samples("val")


def test_a_worker_beyond_the_slots_dealt_is_an_error_naming_it() -> None:
    urls = [["a.tar", "b.tar"], ["c.tar"]]
    assert list(worker_urls(urls, rank=0)) == [{"url": "a.tar"}, {"url": "b.tar"}]  # the training process: worker 0
    read = read_by_workers(
        [lambda: worker_urls(urls, rank=3), lambda s: ({**u, "__url__": u["url"], "__id__": 0} for u in s)], 2
    )
    assert read == {0: [("a.tar", 0), ("b.tar", 0)], 1: [("c.tar", 0)]}
    with pytest.raises(ConfigError, match=r"^rank 3, worker 0 of 1: only 0 slots were dealt to the rank$"):
        list(worker_urls([], rank=3))


def test_unconsumed_leaves_out_only_the_flagged_samples_of_their_shard() -> None:
    samples = [
        {"__url__": url, "__id__": i} for url, ids in (("s/a", range(10, 14)), ("s/b", range(20, 23))) for i in ids
    ]
    left_out = {"s/a": (10, np.array([True, False, True, False]))}
    assert [s["__id__"] for s in unconsumed(samples, left_out)] == [11, 13, 20, 21, 22]
    assert [s["__id__"] for s in unconsumed(samples, {})] == [10, 11, 12, 13, 20, 21, 22]
