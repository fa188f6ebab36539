"""Train and validation loaders over WebDataset shards, one per rank.

resample: every DataLoader worker of every rank draws shards with replacement, seeded by
(seed, epoch, rank, worker); an epoch is ceil(N / (ranks x batch)) batches on every rank.
split: the shards, shuffled by (seed, epoch), are dealt to the ranks x workers slots so each
sample is seen once per epoch; ranks may end with different batch counts.
validation: shards dealt in manifest order, no shuffle, no padding, partial last batches.

Workers batch their own samples; the main process can unbatch, shuffle across workers and
rebatch (`cross_worker_shuffle_samples`), as WebLoader's unbatched().shuffle(n).batched(b).
Each stage is a generator, so it can be fed a plain list. Every batch carries its samples'
ids and keys, so the loop knows what it trained on (see raywds.position).

    from raywds.loader import epoch_plan, train_loader, val_loader
    plan = epoch_plan(manifest, cfg, world.world_size, epoch=0)
    for batch in train_loader(manifest, cfg, world, plan, epoch=0): ...
"""

from __future__ import annotations

import itertools
import multiprocessing
import random
from collections.abc import Callable, Iterable, Iterator
from functools import partial as bind
from typing import Any, NamedTuple

import numpy as np

import torch
import webdataset as wds
from torch.utils.data import DataLoader, get_worker_info

from raywds import decode
from raywds import plan as planner
from raywds.blocks import Blocks, HandedOver
from raywds.config import TrainConfig
from raywds.decode import Encoded
from raywds.errors import ConfigError, DataError
from raywds.plan import EpochPlan
from raywds.position import Position
from raywds.readers import ReadPolicy, tar_samples
from raywds.shards import Manifest, ShardInfo, deal
from raywds.world import World

IMAGE_KEYS = ("jpg", "png", "webp", "jpeg")


class Batch(NamedTuple):
    images: torch.Tensor | Encoded
    """uint8 NCHW, or (`--decode device`) the JPEG bytes and crops the device decodes."""
    labels: torch.Tensor
    ids: torch.Tensor
    """Each sample's id: its shard's offset in manifest order plus its place in the shard."""
    keys: list[str]
    """Each sample's `__key__` in its tar."""


Sample = tuple[Any, int, int, str]


def train_decoder(cfg: TrainConfig) -> Callable[[bytes], Any]:
    size, scale = cfg.image_size_px, (cfg.crop_scale_min, 1.0)
    if cfg.decode == "pil":
        return decode.reference_train(size, scale)
    crop = decode.encoded_crop if cfg.decode == "device" else decode.train_crop
    return bind(crop, size=size, scale=scale)


def val_decoder(cfg: TrainConfig) -> Callable[[bytes], torch.Tensor]:
    return decode.reference_val(cfg.image_size_px) if cfg.decode == "pil" else bind(decode.val_crop, size=cfg.image_size_px)


class Decode:
    """Sample dict -> (image, class index, id, key); the image as `decode` (raywds.decode) makes it."""

    def __init__(self, decode: Callable[[bytes], Any]):
        self.decode = decode

    def __call__(self, sample: dict[str, Any]) -> Sample:
        key = next((k for k in IMAGE_KEYS if k in sample), None)
        if key is None or "cls" not in sample:
            raise DataError(f"sample {sample.get('__key__')} in {sample.get('__url__')} lacks an image or .cls")
        return self.decode(sample[key]), int(sample["cls"]), sample["__id__"], sample["__key__"]


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def slot_seed(tag: str, *parts: object) -> str:
    """The seed string of one stream (the planner's shuffle report replays the same ones)."""
    return "-".join(str(p) for p in (tag, *parts))


def _slot_rng(tag: str, *parts: object) -> random.Random:
    """A generator private to `parts` and this DataLoader worker."""
    worker, _ = _worker()
    return random.Random(slot_seed(tag, *parts, worker))


def resampled_urls(urls: list[str], *, seed: int, epoch: int, rank: int, reseed: int = 0) -> Iterator[dict[str, str]]:
    """Shards drawn uniformly with replacement, forever, seeded per (seed, epoch, rank, worker);
    `reseed` (the samples already done, on resume) starts a fresh stream."""
    rng = _slot_rng("resample", seed, epoch, rank) if not reseed else _slot_rng("resample", seed, epoch, reseed, rank)
    while True:
        yield {"url": rng.choice(urls)}


def slot_urls(slots: list[list[ShardInfo]], rank: int, manifest: Manifest) -> Iterator[dict[str, str]]:
    """The shards dealt to this rank's current DataLoader worker (slot rank x workers + worker)."""
    worker, num_workers = _worker()
    index = rank * num_workers + worker
    if index >= len(slots):
        raise ConfigError(f"slot {index} (rank {rank}, worker {worker} of {num_workers}) is not among the {len(slots)} dealt")
    for shard in slots[index]:
        yield {"url": manifest.url(shard)}


def numbered(samples: Iterable[dict[str, Any]], offsets: dict[str, int]) -> Iterator[dict[str, Any]]:
    """Give each sample its id, the shard's offset (by URL) plus its place in the shard (`__id__`)."""
    url, first, offset, index = "", "", 0, 0
    for sample in samples:
        if sample["__url__"] != url or sample["__key__"] == first:  # a new shard, or the same one drawn again
            url, first, index = sample["__url__"], sample["__key__"], 0
            offset = offsets[url]
        sample["__id__"] = offset + index
        index += 1
        yield sample


def unconsumed(samples: Iterable[dict[str, Any]], consumed: np.ndarray | None) -> Iterator[dict[str, Any]]:
    """Drop the samples an interrupted epoch already trained on."""
    for sample in samples:
        if consumed is None or not consumed[sample["__id__"]]:
            yield sample


def shuffled(src: Iterable[Any], *, buffer: int, rng: random.Random) -> Iterator[Any]:
    """Shuffle through a buffer of `buffer` items (webdataset's shuffle); 0 passes through."""
    if buffer <= 1:
        return iter(src)
    return wds.shuffle(buffer, min(buffer, 100), rng=rng)(iter(src))


def worker_shuffled(src: Iterable[Any], *, buffer: int, seed: int, epoch: int, rank: int) -> Iterator[Any]:
    """Sample shuffle inside a DataLoader worker, seeded per (seed, epoch, rank, worker)."""
    return shuffled(src, buffer=buffer, rng=_slot_rng("shuffle", seed, epoch, rank))


def collate(samples: list[Sample], out_of: decode.OutOf | None = None) -> Batch:
    """Samples -> a Batch; in a worker, the images go into shared memory (`out_of`: raywds.blocks)."""
    images, labels, ids, keys = zip(*samples)
    return Batch(decode.stack(list(images), out_of), torch.as_tensor(labels, dtype=torch.long), torch.as_tensor(ids, dtype=torch.long), list(keys))


def fold_single_tail(batches: Iterable[Batch]) -> Iterator[Batch]:
    """A last batch of one sample joins the batch before it: BatchNorm cannot train on one.
    (With a batch size of one every batch is single, and nothing is folded.)"""
    held: list[Batch] = []  # the last two batches: the tail is only known at the end
    for batch in batches:
        held.append(batch)
        if len(held) == 3:
            yield held.pop(0)
    if len(held) == 2 and len(held[1].keys) == 1 and len(held[0].keys) > 1:
        yield collate([*_samples(held[0]), *_samples(held[1])])
    else:
        yield from held


def _samples(batch: Batch) -> list[Sample]:
    return [(batch.images[i], int(batch.labels[i]), int(batch.ids[i]), batch.keys[i]) for i in range(len(batch.keys))]


def rebatched(batches: Iterable[Batch], *, batch_size: int, buffer: int, rng: random.Random, partial: bool) -> Iterator[Batch]:
    """Main process: unbatch the workers' batches, shuffle across workers, batch again."""
    samples: Iterator[Any] = wds.unbatched()(iter(batches))
    samples = shuffled(samples, buffer=buffer, rng=rng)
    out = wds.batched(batch_size, collation_fn=collate, partial=partial)(samples)
    return fold_single_tail(out) if partial else out


def read_policy(cfg: TrainConfig, *, skip_unreadable: bool) -> ReadPolicy:
    """Exact passes (split, validation) raise on a shard that stays unreadable; resample skips it."""
    return ReadPolicy(read_timeout_s=cfg.read_timeout_s, retries=cfg.read_retries, skip_unreadable=skip_unreadable, cache_dir=cfg.cache_dir)


def _known(manifest: Manifest, split: str) -> dict[str, tuple[int, str]]:
    """Each shard's URL -> (bytes, sha256) from the manifest."""
    return {manifest.url(s): (s.num_bytes, s.sha256) for s in manifest.shards(split)}


def _url_offsets(manifest: Manifest, split: str) -> dict[str, int]:
    offsets = manifest.offsets(split)
    return {manifest.url(s): offsets[s.name] for s in manifest.shards(split)}


def _num_workers(cfg: TrainConfig) -> int:
    return max(1, cfg.num_loader_workers_per_rank)


def _loader(stages: list[Any], cfg: TrainConfig, world: World, *, partial: bool) -> Iterable[Batch]:
    """A DataLoader over the stages then batching (`partial`: keep a short last batch), its
    batches handed over in reused shared-memory blocks (raywds.blocks)."""
    # Workers start afresh each epoch (the pipeline is seeded by epoch), so start them by fork
    # where the OS has it: a process that was itself spawned would otherwise spawn its workers
    # too and re-import torch in each, seconds per epoch. Workers only decode on the CPU.
    workers = cfg.num_loader_workers_per_rank
    context = "fork" if workers and "fork" in multiprocessing.get_all_start_methods() else None
    blocks = Blocks(workers)
    batched = wds.batched(cfg.batch_size_per_rank, collation_fn=bind(collate, out_of=blocks.take), partial=partial)
    loader = DataLoader(
        wds.DataPipeline(*stages, batched, blocks.leased),
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=context,
        pin_memory=world.device.startswith("cuda"),
    )
    return HandedOver(loader, blocks)


def epoch_plan(manifest: Manifest, cfg: TrainConfig, num_ranks: int, *, epoch: int, position: Position | None = None) -> EpochPlan:
    """The plan for `epoch`, or for what is left of it after `position` (same epoch)."""
    shards = manifest.shards("train")
    resuming = position is not None and position.epoch == epoch and position.samples_done > 0
    if cfg.mode == "resample":
        return planner.resample_plan(
            manifest.num_samples("train"), num_ranks=num_ranks, num_workers=_num_workers(cfg),
            batch_size=cfg.batch_size_per_rank, batches_per_epoch=cfg.batches_per_epoch,
            samples_done=position.samples_done if resuming and position else 0,
        )  # fmt: skip
    if resuming and position is not None:
        shards = planner.remaining(shards, position.consumed_per_shard(manifest))
    return planner.split_plan(
        shards, num_ranks=num_ranks, num_workers=_num_workers(cfg), batch_size=cfg.batch_size_per_rank,
        seed=cfg.seed, epoch=epoch, num_samples=manifest.num_samples("train"), resumed=resuming,
    )  # fmt: skip


def check_plan(plan: EpochPlan, manifest: Manifest) -> None:
    """Refuse, before any step, a plan that would hang or lose data."""
    refused = planner.refusals(planner.check(plan, num_shards=len(manifest.shards("train"))))
    if refused:
        raise ConfigError(refused[0])


class EpochLoader:
    """One epoch of batches for one rank; its length is the plan's batch count for the rank."""

    def __init__(self, batches: Callable[[], Iterator[Batch]], plan: EpochPlan, rank: int):
        self.batches = batches
        self.plan = plan
        self.rank = rank

    def __iter__(self) -> Iterator[Batch]:
        if self.plan.mode == "resample":
            return itertools.islice(self.batches(), len(self))
        return self.batches()  # split: the epoch's own end; the loop checks the count against the manifest

    def __len__(self) -> int:
        return self.plan.batches_per_rank[self.rank]


def train_loader(manifest: Manifest, cfg: TrainConfig, world: World, plan: EpochPlan, *, epoch: int, position: Position | None = None) -> EpochLoader:
    """This rank's training batches for `epoch` as `plan` deals them; after `position`, only
    what the epoch has not yet delivered (split) or a reseeded stream (resample)."""
    rank = world.rank
    resuming = position is not None and position.epoch == epoch
    source: Any
    if plan.mode == "resample":
        urls = [manifest.url(s) for s in manifest.shards("train")]
        reseed = position.samples_done if resuming and position else 0
        source = bind(resampled_urls, urls, seed=cfg.seed, epoch=epoch, rank=rank, reseed=reseed)
        consumed = None
    else:
        source = bind(slot_urls, plan.slots, rank, manifest)
        consumed = position.consumed if resuming and position else None
    stages = [
        source,
        bind(tar_samples, policy=read_policy(cfg, skip_unreadable=plan.mode == "resample"), known=_known(manifest, "train")),
        bind(numbered, offsets=_url_offsets(manifest, "train")),
        bind(unconsumed, consumed=consumed),
        bind(worker_shuffled, buffer=cfg.shuffle_buffer_samples, seed=cfg.seed, epoch=epoch, rank=rank),
        wds.map(Decode(train_decoder(cfg))),
    ]
    loader = _loader(stages, cfg, world, partial=plan.mode == "split")
    if plan.mode == "resample" and cfg.cross_worker_shuffle_samples == 0:
        return EpochLoader(lambda: iter(loader), plan, rank)

    def batches() -> Iterator[Batch]:
        rng = random.Random(slot_seed("cross", cfg.seed, epoch, rank))
        return rebatched(loader, batch_size=cfg.batch_size_per_rank, buffer=cfg.cross_worker_shuffle_samples, rng=rng, partial=plan.mode == "split")

    return EpochLoader(batches, plan, rank)


def split_slots(manifest: Manifest, split: str, num_slots: int) -> list[list[ShardInfo]]:
    """Deal `split`'s shards, in manifest order, to `num_slots` slots."""
    return deal(list(manifest.shards(split)), num_slots)


def val_loader(manifest: Manifest, cfg: TrainConfig, world: World) -> Iterable[Batch]:
    """This rank's share of the validation split: every sample once across ranks, no padding."""
    slots = split_slots(manifest, "val", world.world_size * _num_workers(cfg))
    stages = [
        bind(slot_urls, slots, world.rank, manifest),
        bind(tar_samples, policy=read_policy(cfg, skip_unreadable=False), known=_known(manifest, "val")),
        bind(numbered, offsets=_url_offsets(manifest, "val")),
        wds.map(Decode(val_decoder(cfg))),
    ]
    return _loader(stages, cfg, world, partial=True)
