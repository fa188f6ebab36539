"""Loaders on simulated ranks: equal batch counts (resample), exact coverage (split, validation)."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from raywds.config import TrainConfig
from raywds.errors import ConfigError
from raywds.loader import train_loader, val_loader
from raywds.shards import ShardInfo, deal, read_manifest
from raywds.world import World


def config(shards: Path, **overrides: object) -> TrainConfig:
    values: dict = dict(data=str(shards), batch_size_per_rank=8, image_size_px=24, num_loader_workers_per_rank=2, model="demo")
    values.update(overrides)
    return TrainConfig(**values)


def fingerprints(batches) -> Counter:
    """(label, pixel checksum) per sample: the val transform is deterministic, so this names a sample."""
    found: Counter = Counter()
    for images, labels in batches:
        for image, label in zip(images, labels):
            found[(int(label), round(float(image.double().sum()), 3))] += 1
    return found


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_resample_gives_every_rank_the_same_batch_count(shards: Path, world_size: int) -> None:
    manifest = read_manifest(str(shards))
    cfg = config(shards)
    expected = math.ceil(120 / (world_size * 8))
    label_runs = []
    for rank in range(world_size):
        batches = list(train_loader(manifest, cfg, World(rank=rank, world_size=world_size), epoch=0))
        assert len(batches) == expected, f"rank {rank} of {world_size}"
        assert all(images.shape == (8, 3, 24, 24) for images, _ in batches), "resample batches are always full"
        label_runs.append(torch.cat([labels for _, labels in batches]).tolist())
    if world_size > 1:
        assert label_runs[0] != label_runs[1], "ranks must draw different data"


def test_resample_is_seeded_per_epoch(shards: Path) -> None:
    manifest = read_manifest(str(shards))
    cfg = config(shards, num_loader_workers_per_rank=0)
    world = World(rank=0, world_size=2)

    def labels(epoch: int) -> list[int]:
        return torch.cat([y for _, y in train_loader(manifest, cfg, world, epoch=epoch)]).tolist()

    assert labels(0) == labels(0)
    assert labels(0) != labels(1)


@pytest.mark.parametrize("world_size,workers", [(1, 0), (2, 2), (3, 1)])
def test_validation_sees_every_sample_once_across_ranks(shards: Path, world_size: int, workers: int) -> None:
    manifest = read_manifest(str(shards))
    reference = fingerprints(val_loader(manifest, config(shards, num_loader_workers_per_rank=0), World()))
    assert sum(reference.values()) == 50 and len(reference) == 50
    cfg = config(shards, num_loader_workers_per_rank=workers)
    combined: Counter = Counter()
    for rank in range(world_size):
        combined += fingerprints(val_loader(manifest, cfg, World(rank=rank, world_size=world_size)))
    assert combined == reference


def test_split_mode_covers_the_epoch_exactly_and_reshuffles(shards: Path) -> None:
    manifest = read_manifest(str(shards))
    cfg = config(shards, mode="split", num_loader_workers_per_rank=2, image_size_px=32, crop_scale_min=1.0)
    labels_per_epoch = []
    for epoch in range(2):
        counts, labels = [], Counter()
        for rank in range(2):
            batches = list(train_loader(manifest, cfg, World(rank=rank, world_size=2), epoch=epoch))
            counts.append(sum(len(y) for _, y in batches))
            labels += Counter(int(v) for _, y in batches for v in y)
        assert sum(counts) == 120
        assert labels == Counter({c: 12 for c in range(10)})
        labels_per_epoch.append(counts)
    assert sorted(labels_per_epoch[0]) == [56, 64]  # 4 slots: 32+32 / 32+24 or similar, never all on one rank


def test_split_mode_refuses_fewer_shards_than_slots(shards: Path) -> None:
    manifest = read_manifest(str(shards))
    cfg = config(shards, mode="split", num_loader_workers_per_rank=4)
    with pytest.raises(ConfigError, match=r"8 shards < 3 ranks x 4 workers; reconvert with a smaller --maxcount"):
        train_loader(manifest, cfg, World(rank=0, world_size=3), epoch=0)


def test_deal_places_every_shard_once_and_balances_samples() -> None:
    rng = random.Random(0)
    for _ in range(200):
        shards = [ShardInfo(f"s{i}", rng.randint(1, 100), 0, "") for i in range(rng.randint(1, 40))]
        slots = deal(shards, rng.randint(1, 12))
        assert sorted(s.name for slot in slots for s in slot) == sorted(s.name for s in shards)
        loads = [sum(s.num_samples for s in slot) for slot in slots]
        assert max(loads) - min(loads) <= max(s.num_samples for s in shards)
