"""Train and validation loaders over WebDataset shards, one per rank.

resample: every DataLoader worker of every rank draws shards with replacement, seeded by
(seed, epoch, rank, worker); an epoch is ceil(N / (ranks x batch)) batches on every rank.
split: the shards, shuffled by (seed, epoch), are dealt to the ranks x workers slots so each
sample is seen once per epoch; ranks may end with different batch counts.
validation: shards dealt in manifest order, no shuffle, no padding, partial last batches.

    from raywds.loader import train_loader, val_loader
    for images, labels in train_loader(manifest, cfg, world, epoch=0): ...
"""

from __future__ import annotations

import io
import itertools
import math
import multiprocessing
import random
from functools import partial as bind
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, get_worker_info
from torchvision import transforms

from raywds.config import TrainConfig
from raywds.errors import ConfigError, DataError
from raywds.shards import Manifest, ShardInfo, deal
from raywds.world import World

IMAGE_KEYS = ("jpg", "png", "webp", "jpeg")
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)

Batch = tuple[torch.Tensor, torch.Tensor]


def train_transform(cfg: TrainConfig) -> Callable[[Image.Image], torch.Tensor]:
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(cfg.image_size_px, scale=(cfg.crop_scale_min, 1.0)),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )


def val_transform(cfg: TrainConfig) -> Callable[[Image.Image], torch.Tensor]:
    return transforms.Compose(
        [
            transforms.Resize(round(cfg.image_size_px / 0.875)),
            transforms.CenterCrop(cfg.image_size_px),
            transforms.ToTensor(),
            transforms.Normalize(MEAN, STD),
        ]
    )


class Decode:
    """Sample dict -> (image tensor, class index). PIL sniffs the real format, so grayscale,
    CMYK and PNG-named-JPEG files all come out RGB."""

    def __init__(self, transform: Callable[[Image.Image], torch.Tensor]):
        self.transform = transform

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        key = next((k for k in IMAGE_KEYS if k in sample), None)
        if key is None or "cls" not in sample:
            raise DataError(f"sample {sample.get('__key__')} in {sample.get('__url__')} lacks an image or .cls")
        with Image.open(io.BytesIO(sample[key])) as img:
            rgb = img.convert("RGB")
        return self.transform(rgb), int(sample["cls"])


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _slot_rng(tag: str, seed: int, epoch: int, rank: int) -> random.Random:
    """A generator private to this (seed, epoch, rank, DataLoader worker)."""
    worker, _ = _worker()
    return random.Random(f"{tag}-{seed}-{epoch}-{rank}-{worker}")


def resampled_urls(urls: list[str], *, seed: int, epoch: int, rank: int) -> Iterator[dict[str, str]]:
    """Shards drawn uniformly with replacement, forever, seeded per (seed, epoch, rank, worker)."""
    rng = _slot_rng("resample", seed, epoch, rank)
    while True:
        yield {"url": rng.choice(urls)}


def slot_shards(slots: list[list[ShardInfo]], rank: int, manifest: Manifest) -> Iterator[dict[str, str]]:
    """The shards dealt to this rank's current DataLoader worker."""
    worker, num_workers = _worker()
    for shard in slots[rank * num_workers + worker]:
        yield {"url": manifest.url(shard)}


def shuffled(src: Iterable[dict[str, Any]], *, buffer: int, seed: int, epoch: int, rank: int) -> Iterator[dict[str, Any]]:
    """Sample shuffle within a worker, seeded per (seed, epoch, rank, worker)."""
    rng = _slot_rng("shuffle", seed, epoch, rank)
    return wds.shuffle(buffer, min(buffer, 100), rng=rng)(src)


def split_slots(manifest: Manifest, split: str, num_slots: int, *, seed: str | None) -> list[list[ShardInfo]]:
    """Deal `split`'s shards to `num_slots` slots; `seed` None keeps manifest order."""
    shards = list(manifest.shards(split))
    if seed is not None:
        random.Random(seed).shuffle(shards)
    return deal(shards, num_slots)


def _num_workers(cfg: TrainConfig) -> int:
    return max(1, cfg.num_loader_workers_per_rank)


def _loader(pipeline: wds.DataPipeline, cfg: TrainConfig, world: World) -> DataLoader:
    # Workers start afresh each epoch (the pipeline is seeded by epoch), so start them by fork
    # where the OS has it: a process that was itself spawned would otherwise spawn its workers
    # too and re-import torch in each, seconds per epoch. Workers only decode on the CPU.
    workers = cfg.num_loader_workers_per_rank
    context = "fork" if workers and "fork" in multiprocessing.get_all_start_methods() else None
    return DataLoader(
        pipeline,
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=context,
        pin_memory=world.device.startswith("cuda"),
    )


def _collate(samples: list[tuple[torch.Tensor, int]]) -> Batch:
    images, labels = zip(*samples)
    return torch.stack(images), torch.tensor(labels, dtype=torch.long)


def num_resample_batches(manifest: Manifest, cfg: TrainConfig, world: World) -> int:
    """Batches per epoch on every rank in resample mode: ceil(N / (ranks x batch))."""
    return math.ceil(manifest.num_samples("train") / (world.world_size * cfg.batch_size_per_rank))


class EpochLoader:
    """One epoch of batches for one rank; `len()` is known in resample mode."""

    def __init__(self, loader: DataLoader, num_batches: int | None):
        self.loader = loader
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[Batch]:
        if self.num_batches is None:
            return iter(self.loader)
        return itertools.islice(iter(self.loader), self.num_batches)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("split-mode epochs have no fixed length per rank")
        return self.num_batches


def train_loader(manifest: Manifest, cfg: TrainConfig, world: World, *, epoch: int) -> EpochLoader:
    """This rank's training batches for `epoch`."""
    rank = world.rank
    stages: list[Any]
    if cfg.mode == "resample":
        urls = [manifest.url(s) for s in manifest.shards("train")]
        stages = [bind(resampled_urls, urls, seed=cfg.seed, epoch=epoch, rank=rank)]
        num_batches: int | None = num_resample_batches(manifest, cfg, world)
        partial = False
    else:
        num_slots = world.world_size * _num_workers(cfg)
        num_shards = len(manifest.shards("train"))
        if num_shards < num_slots:
            raise ConfigError(
                f"split mode needs at least one shard per (rank, loader worker): {num_shards} shards < "
                f"{world.world_size} ranks x {_num_workers(cfg)} workers; reconvert with a smaller --maxcount "
                f"or use fewer --loader-workers"
            )
        slots = split_slots(manifest, "train", num_slots, seed=f"split-{cfg.seed}-{epoch}")
        stages = [bind(slot_shards, slots, rank, manifest)]
        num_batches, partial = None, True
    stages += [
        wds.tarfile_to_samples(handler=wds.reraise_exception),
        bind(shuffled, buffer=cfg.shuffle_buffer_samples, seed=cfg.seed, epoch=epoch, rank=rank),
        wds.map(Decode(train_transform(cfg))),
        wds.batched(cfg.batch_size_per_rank, collation_fn=_collate, partial=partial),
    ]
    return EpochLoader(_loader(wds.DataPipeline(*stages), cfg, world), num_batches)


def val_loader(manifest: Manifest, cfg: TrainConfig, world: World) -> Iterable[Batch]:
    """This rank's share of the validation split: every sample once across ranks, no padding."""
    slots = split_slots(manifest, "val", world.world_size * _num_workers(cfg), seed=None)
    pipeline = wds.DataPipeline(
        bind(slot_shards, slots, world.rank, manifest),
        wds.tarfile_to_samples(handler=wds.reraise_exception),
        wds.map(Decode(val_transform(cfg))),
        wds.batched(cfg.batch_size_per_rank, collation_fn=_collate, partial=True),
    )
    return _loader(pipeline, cfg, world)
