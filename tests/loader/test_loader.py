"""Loaders on simulated ranks with real DataLoader workers: equal batch counts (resample),
exactly-once epochs (split, validation, resumed epochs), and the stages fed plain lists."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from support.data import UNEVEN_SIZES, tar_keys
from support.runs import small_config

from raywds.data.manifest import read_manifest
from raywds.errors import ConfigError
from raywds.loader.decodings import Encoded
from raywds.loader.loader import expected, train_loader, val_loader
from raywds.loader.readers import ReadPolicy, tar_samples
from raywds.loader.stages import Batch, fold_single_tail, rebatched
from raywds.plan.checks import check_plan
from raywds.plan.modes import Resample, Split, epoch_plan
from raywds.plan.position import Position, done_in
from raywds.train.config import TrainConfig
from raywds.world import World


def config(shards: Path, **overrides: object) -> TrainConfig:
    return small_config(shards, **{"batch_size": 8, "image_size": 24, "loader_workers": 2, **overrides})


def epoch(
    shards: Path, cfg: TrainConfig, world_size: int, n: int = 0, position: Position | None = None
) -> list[list[Batch]]:
    """Every rank's batches for epoch `n`, each rank built as training builds it."""
    manifest = read_manifest(str(shards))
    plan = epoch_plan(manifest, cfg, world_size, epoch=n, done=done_in(position, n))
    check_plan(plan, manifest)
    ranks = []
    for rank in range(world_size):
        loader = train_loader(
            manifest, cfg.loader(), World(rank=rank, world_size=world_size), plan, epoch=n, position=position
        )
        batches = list(loader)
        assert len(batches) == len(loader) == plan.batches_per_rank[rank], (
            f"rank {rank}: the plan must predict the batch count"
        )
        ranks.append(batches)
    return ranks


def keys(ranks: list[list[Batch]]) -> Counter:
    return Counter(k for batches in ranks for b in batches for k in b.keys)


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_resample_gives_every_rank_the_same_batch_count(shards: Path, world_size: int) -> None:
    ranks = epoch(shards, config(shards), world_size)
    expected = math.ceil(120 / (world_size * 8))
    assert [len(r) for r in ranks] == [expected] * world_size
    assert all(b.images.shape == (8, 3, 24, 24) for r in ranks for b in r), "resample batches are always full"
    if world_size > 1:
        streams = [[k for b in r for k in b.keys] for r in ranks]
        assert streams[0] != streams[1], "ranks must draw different data"


def test_resample_workers_of_one_rank_draw_different_streams(shards: Path) -> None:
    # A DataLoader hands over its workers' batches in turn: even batches from worker 0, odd from worker 1.
    (batches,) = epoch(shards, config(shards, batches_per_epoch=8, worker_shuffle_buffer=0), 1)
    worker0 = [k for b in batches[0::2] for k in b.keys]
    worker1 = [k for b in batches[1::2] for k in b.keys]
    assert len(worker0) == len(worker1) == 32 and worker0 != worker1


def test_resample_batches_per_epoch_and_cross_worker_shuffle_keep_counts(shards: Path) -> None:
    ranks = epoch(shards, config(shards, batches_per_epoch=5, cross_worker_shuffle_buffer=20), 3)
    assert [len(r) for r in ranks] == [5, 5, 5]
    assert all(len(b.keys) == 8 for r in ranks for b in r)


def test_resample_is_seeded_per_epoch_and_reseeded_on_resume(shards: Path) -> None:
    cfg = config(shards, loader_workers=0)

    def stream(n: int, position: Position | None = None) -> list[str]:
        return [k for b in epoch(shards, cfg, 2, n, position)[0] for k in b.keys]

    assert stream(0) == stream(0)
    assert stream(0) != stream(1)
    manifest = read_manifest(str(shards))
    resumed = Position(
        mode=Resample(), epoch=0, step=3, samples_done=48, shards_done=None, dataset=manifest.fingerprint("train")
    )
    after = stream(0, resumed)
    assert len(after) == 8 * math.ceil((120 - 48) / 16), "a resumed epoch takes only the batches that were left"
    assert after != stream(0)[: len(after)], "and draws a fresh stream"


@pytest.mark.parametrize("world_size,workers", [(1, 0), (2, 2), (3, 1)])
def test_validation_sees_every_sample_once_across_ranks(shards: Path, world_size: int, workers: int) -> None:
    manifest = read_manifest(str(shards))
    cfg = config(shards, loader_workers=workers)
    seen = Counter(
        k
        for rank in range(world_size)
        for b in val_loader(manifest, cfg.loader(), World(rank=rank, world_size=world_size))
        for k in b.keys
    )
    assert seen == Counter(tar_keys(shards, "val"))


@pytest.mark.parametrize(
    "world_size,workers,batch,cross,decode",
    [
        (1, 0, 7, 0, "cpu"),
        (2, 2, 8, 0, "cpu"),
        (3, 1, 5, 0, "pil"),
        (2, 2, 16, 50, "cpu"),
        (4, 2, 3, 10, "cpu"),
        (2, 2, 5, 10, "device"),
    ],
)
def test_split_sees_every_key_once_on_uneven_shards(
    uneven: Path, world_size: int, workers: int, batch: int, cross: int, decode: str
) -> None:
    cfg = config(
        uneven,
        mode="split",
        loader_workers=workers,
        batch_size=batch,
        cross_worker_shuffle_buffer=cross,
        decode=decode,
    )
    ranks = epoch(uneven, cfg, world_size)
    assert keys(ranks) == Counter(tar_keys(uneven)), "each key exactly once across ranks and workers"
    for batches in ranks:
        sizes = [len(b.keys) for b in batches]
        assert all(s >= 2 for s in sizes[-1:]) or len(sizes) == 1, "no last batch of a single sample"
        assert all(s == batch for s in sizes[:-2]), "rebatched in the main process: only the tail is partial"
        for b in batches:
            assert len(b.images) == b.labels.shape[0] == b.ids.shape[0] == len(b.keys)
            assert isinstance(b.images, Encoded) == (decode == "device"), (
                "device decoding: workers send JPEG bytes and crops"
            )
            images = b.images.decode("cpu") if isinstance(b.images, Encoded) else b.images
            assert images.shape == (len(b.keys), 3, 24, 24) and images.dtype == torch.uint8


def test_split_reshuffles_each_epoch(uneven: Path) -> None:
    cfg = config(uneven, mode="split", loader_workers=1)
    first = [[k for b in r for k in b.keys] for r in epoch(uneven, cfg, 2, 0)]
    second = [[k for b in r for k in b.keys] for r in epoch(uneven, cfg, 2, 1)]
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))


def test_batch_ids_name_the_sample(uneven: Path) -> None:
    """An id is the shard's offset in manifest order plus the place in the shard, so ids map back to keys."""
    cfg = config(uneven, mode="split", loader_workers=2)
    by_id = {int(i): k for r in epoch(uneven, cfg, 2) for b in r for i, k in zip(b.ids, b.keys)}
    assert sorted(by_id) == list(range(120))
    assert [by_id[i] for i in range(120)] == tar_keys(uneven)


@pytest.mark.parametrize("new_world_size", [2, 3])
def test_split_resume_trains_on_exactly_the_rest(uneven: Path, new_world_size: int) -> None:
    manifest = read_manifest(str(uneven))
    cfg = config(uneven, mode="split", loader_workers=2)
    done = np.zeros(120, dtype=bool)
    done[random.Random(1).sample(range(120), 47)] = True  # what an interrupted epoch delivered
    position = Position.of_flags(
        done,
        manifest.shards("train"),
        mode=Split(),
        epoch=0,
        step=3,
        samples_done=47,
        dataset=manifest.fingerprint("train"),
    )
    rest = keys(epoch(uneven, cfg, new_world_size, 0, position))
    all_keys = tar_keys(uneven)
    assert rest == Counter(k for i, k in enumerate(all_keys) if not done[i])


def test_split_refuses_fewer_shards_than_slots(shards: Path) -> None:
    cfg = config(shards, mode="split", loader_workers=4)
    manifest = read_manifest(str(shards))
    with pytest.raises(
        ConfigError,
        match=r"8 shards < 3 ranks x 4 workers, so 4 workers would read nothing; reconvert with a smaller --maxcount",
    ):
        check_plan(epoch_plan(manifest, cfg, 3, epoch=0), manifest)


def _batch(keys: list[str]) -> Batch:
    n = len(keys)
    return Batch(torch.zeros(n, 3, 2, 2, dtype=torch.uint8), torch.zeros(n, dtype=torch.long), torch.arange(n), keys)


def test_fold_single_tail_from_plain_batches() -> None:
    folded = list(fold_single_tail([_batch(["a", "b"]), _batch(["c", "d"]), _batch(["e"])]))
    assert [b.keys for b in folded] == [["a", "b"], ["c", "d", "e"]]
    assert [b.keys for b in fold_single_tail([_batch(["a"])])] == [["a"]]
    assert [b.keys for b in fold_single_tail([_batch(["a", "b"]), _batch(["c", "d"])])] == [["a", "b"], ["c", "d"]]


def test_rebatched_mixes_workers_and_keeps_every_sample() -> None:
    worker_batches = [_batch([f"w{w}-{i}-{j}" for j in range(4)]) for i in range(5) for w in range(2)]
    out = list(rebatched(worker_batches, batch_size=6, buffer=12, rng=random.Random(0), partial=True))
    flat = [k for b in out for k in b.keys]
    assert sorted(flat) == sorted(k for b in worker_batches for k in b.keys)
    assert [len(b.keys) for b in out] == [6] * 6 + [4]
    assert flat != [k for b in worker_batches for k in b.keys], "the buffer reorders"


def test_sample_ids_restart_per_shard_even_when_a_shard_is_drawn_twice(uneven: Path) -> None:
    manifest = read_manifest(str(uneven))
    shards = manifest.shards("train")
    order = [shards[3], shards[1], shards[1], shards[0]]  # 16, 30, 30, 1 samples
    samples = list(tar_samples([{"url": manifest.url(s)} for s in order], ReadPolicy(), expected(manifest, "train")))
    train = manifest.shards("train")  # ids are numbered through the split in manifest order
    offsets = {
        s.name: first for s, first in zip(train, itertools.accumulate((s.num_samples for s in train), initial=0))
    }
    want = [offsets[s.name] + i for s in order for i in range(s.num_samples)]
    assert [s["__id__"] for s in samples] == want


def test_uneven_fixture_is_really_uneven(uneven: Path) -> None:
    assert [s.num_samples for s in read_manifest(str(uneven)).shards("train")] == UNEVEN_SIZES


@pytest.mark.parametrize(
    ("mode", "cross"), [("resample", 0), ("resample", 24), ("split", 0), ("split", 24)], ids=lambda v: str(v)
)
def test_the_shuffle_replay_draws_what_the_loader_draws(shards: Path, mode: str, cross: int) -> None:
    """`raywds plan --shuffle-report` replays the loader without reading a shard: rank 1 of 2, two
    loader workers, each with its own shard draws and shuffle, sample for sample."""
    from raywds.loader.mixing import replay, sorted_labels

    cfg = config(shards, mode=mode, worker_shuffle_buffer=10, cross_worker_shuffle_buffer=cross, seed=5)
    manifest = read_manifest(str(shards))
    plan = epoch_plan(manifest, cfg, 2, epoch=1)
    loaded = list(train_loader(manifest, cfg.loader(), World(rank=1, world_size=2), plan, epoch=1))
    replayed = replay(
        plan,
        manifest.shards("train"),
        sorted_labels(120, 10),
        seed=5,
        epoch=1,
        worker_buffer=10,
        cross_buffer=cross,
        num_batches=None,
        rank=1,
    )
    assert [b.ids.tolist() for b in replayed] == [b.ids.tolist() for b in loaded]


def crops_by_id(ranks: list[list[Batch]]) -> dict[int, torch.Tensor]:
    return {int(i): b.images[j].clone() for batches in ranks for b in batches for j, i in enumerate(b.ids)}


@pytest.mark.parametrize("decode", ["cpu", pytest.param("pil", marks=pytest.mark.slow)])
def test_a_samples_crop_depends_on_seed_epoch_and_id_only(uneven: Path, decode: str) -> None:
    """The crop comes from the sample's own generator: neither the worker count nor the rank
    count nor the order samples arrive in changes it; the epoch and the seed do."""
    base = {"mode": "split", "decode": decode, "worker_shuffle_buffer": 0}
    one = crops_by_id(epoch(uneven, config(uneven, loader_workers=0, **base), 1))
    shuffled = {**base, "worker_shuffle_buffer": 30}
    many = crops_by_id(epoch(uneven, config(uneven, loader_workers=2, **shuffled), 2))
    assert one.keys() == many.keys() and len(one) == 120
    assert all(torch.equal(one[i], many[i]) for i in one), "1 rank x 0 workers and 2 ranks x 2 workers must agree"
    later = crops_by_id(epoch(uneven, config(uneven, loader_workers=0, **base), 1, n=1))
    assert sum(not torch.equal(one[i], later[i]) for i in one) > 100, "the next epoch draws new crops"
    reseeded = crops_by_id(epoch(uneven, config(uneven, loader_workers=0, seed=1, **base), 1))
    assert sum(not torch.equal(one[i], reseeded[i]) for i in one) > 100, "another seed draws new crops"


def test_the_loader_config_is_the_run_configs_slice() -> None:
    from raywds.errors import ConfigError

    cfg = small_config("shards/", loader_workers=3, cache_dir="/tmp/c", verify_hashes=True, seed=5)
    sliced = cfg.loader()
    assert (sliced.loader_workers, sliced.slots, sliced.batch_size, sliced.seed) == (3, 3, 16, 5)
    assert sliced.read_policy(skip_unreadable=True).cache_dir == "/tmp/c" and sliced.verify_hashes
    assert small_config("shards/", loader_workers=0).loader().slots == 1
    with pytest.raises(ConfigError, match="chosen at each epoch's start"):
        small_config("shards/", loader_workers="auto").loader()
