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
import logging
import multiprocessing
import random
import re
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
from raywds.readers import Expected, Failures, ReadPolicy, tar_samples
from raywds.shards import Manifest, ShardInfo, deal
from raywds.world import World

IMAGE_KEYS = ("jpg", "png", "webp", "jpeg")
log = logging.getLogger(__name__)


class Batch(NamedTuple):
    images: torch.Tensor | Encoded
    """uint8 NCHW, or (`--decode device`) the JPEG bytes and crops the device decodes."""
    labels: torch.Tensor
    ids: torch.Tensor
    """Each sample's id: its shard's offset in manifest order plus its place in the shard."""
    keys: list[str]
    """Each sample's `__key__` in its tar."""
    bad_samples: tuple[str, ...] = ()
    """resample mode: why each sample skipped since the worker's previous batch could not be used."""
    bad_shards: tuple[str, ...] = ()
    """resample mode: why each shard skipped since the worker's previous batch could not be read."""


Sample = tuple[Any, int, int, str]


def train_decoder(cfg: TrainConfig) -> Callable[[bytes], Any]:
    size, scale = cfg.image_size_px, (cfg.crop_scale_min, 1.0)
    if cfg.decode == "pil":
        return decode.reference_train(size, scale)
    crop = decode.encoded_crop if cfg.decode == "device" else decode.train_crop
    return bind(crop, size=size, scale=scale)


def val_decoder(cfg: TrainConfig) -> Callable[[bytes], torch.Tensor]:
    return decode.reference_val(cfg.image_size_px) if cfg.decode == "pil" else bind(decode.val_crop, size=cfg.image_size_px)


class SampleError(DataError):
    """One sample cannot be used; the message names its shard, key and member."""


MAX_LOGGED = 5
"""Bad samples a loader worker logs in full per epoch; the rest are only counted."""


class Skips:
    """A loader worker's policy for bad samples and unreadable shards: raise (exact passes), or
    skip, log the first few and hand the reasons on with the worker's next batch (resample)."""

    def __init__(self, policy: ReadPolicy):
        self.shards = Failures(policy)
        self.samples: list[str] = []
        self.num_logged = 0
        self.shards_sent = 0

    def bad_sample(self, error: SampleError) -> None:
        if not self.shards.policy.skip_unreadable:
            raise error
        self.samples.append(str(error))
        if self.num_logged < MAX_LOGGED:
            self.num_logged += 1
            log.warning("skipped a bad sample: %s", error)

    def attach(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """Stage: each batch carries what was skipped since the previous one."""
        for batch in batches:
            shards = self.shards.skipped[self.shards_sent :]
            self.shards_sent += len(shards)
            samples, self.samples = self.samples, []
            yield batch._replace(bad_samples=tuple(samples), bad_shards=tuple(shards)) if samples or shards else batch


def _what(e: BaseException) -> str:
    """A decoder's complaint in one line (torchvision's carry a C++ file and line first)."""
    text = (str(e).splitlines() or [""])[0] or type(e).__name__
    text = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", text)  # PIL names the buffer it read
    return text.rsplit(".cpp:", 1)[-1].split(", ", 1)[-1] if ".cpp:" in text else text


def decoded(samples: Iterable[dict[str, Any]], decode: Callable[[bytes], Any], skips: Skips) -> Iterator[Sample]:
    """Sample dicts -> (image, class index, id, key), the image as `decode` (raywds.decode) makes
    it; a sample without an image or class, or whose image or class cannot be read, goes to `skips`."""
    for sample in samples:
        key, url = sample["__key__"], sample["__url__"]
        ext = next((k for k in IMAGE_KEYS if k in sample), None)
        member = f"{key}.{ext}"
        try:
            if ext is None or "cls" not in sample:
                member = f"{key}.*"
                raise ValueError(f"has no {'image' if ext is None else '.cls'} member (found {', '.join(sorted(k for k in sample if not k.startswith('__')))})")
            try:
                label = int(sample["cls"])
            except ValueError:
                member = f"{key}.cls"
                raise ValueError(f"class {bytes(sample['cls'][:20])!r} is not a number") from None
            image = decode(sample[ext])
        except Exception as e:  # noqa: BLE001 - PIL, libjpeg and torchvision raise many types for bad bytes
            skips.bad_sample(SampleError(f"shard {url}: sample {key} ({member}): {_what(e)}"))
            continue
        yield image, label, sample["__id__"], key


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


def collate(samples: list[Sample], out_of: decode.OutOf | None = None, *, bad_samples: tuple[str, ...] = (), bad_shards: tuple[str, ...] = ()) -> Batch:
    """Samples -> a Batch; in a worker, the images go into shared memory (`out_of`: raywds.blocks)."""
    images, labels, ids, keys = zip(*samples)
    return Batch(
        decode.stack(list(images), out_of), torch.as_tensor(labels, dtype=torch.long), torch.as_tensor(ids, dtype=torch.long), list(keys),
        bad_samples, bad_shards,
    )  # fmt: skip


def fold_single_tail(batches: Iterable[Batch]) -> Iterator[Batch]:
    """A last batch of one sample joins the batch before it: BatchNorm cannot train on one.
    (With a batch size of one every batch is single, and nothing is folded.)"""
    held: list[Batch] = []  # the last two batches: the tail is only known at the end
    for batch in batches:
        held.append(batch)
        if len(held) == 3:
            yield held.pop(0)
    if len(held) == 2 and len(held[1].keys) == 1 and len(held[0].keys) > 1:
        a, b = held
        yield collate([*_samples(a), *_samples(b)], bad_samples=a.bad_samples + b.bad_samples, bad_shards=a.bad_shards + b.bad_shards)
    else:
        yield from held


def _samples(batch: Batch) -> list[Sample]:
    return [(batch.images[i], int(batch.labels[i]), int(batch.ids[i]), batch.keys[i]) for i in range(len(batch.keys))]


def rebatched(batches: Iterable[Batch], *, batch_size: int, buffer: int, rng: random.Random, partial: bool) -> Iterator[Batch]:
    """Main process: unbatch the workers' batches, shuffle across workers, batch again; what the
    workers skipped travels on with the next batch out."""
    skipped: tuple[list[str], list[str]] = ([], [])

    def unbatched() -> Iterator[Sample]:
        for batch in batches:
            skipped[0].extend(batch.bad_samples)
            skipped[1].extend(batch.bad_shards)
            yield from _samples(batch)

    def collated(samples: list[Sample]) -> Batch:
        batch = collate(samples, bad_samples=tuple(skipped[0]), bad_shards=tuple(skipped[1]))
        skipped[0].clear()
        skipped[1].clear()
        return batch

    out = wds.batched(batch_size, collation_fn=collated, partial=partial)(shuffled(unbatched(), buffer=buffer, rng=rng))
    return fold_single_tail(out) if partial else out


def read_policy(cfg: TrainConfig, *, skip_unreadable: bool) -> ReadPolicy:
    """Exact passes (split, validation) raise on a shard that stays unreadable; resample skips it."""
    return ReadPolicy(read_timeout_s=cfg.read_timeout_s, retries=cfg.read_retries, skip_unreadable=skip_unreadable, cache_dir=cfg.cache_dir)


def expected(manifest: Manifest, split: str) -> dict[str, Expected]:
    """Each shard's URL -> what the manifest says reading it must give."""
    offsets = manifest.offsets(split)
    return {manifest.url(s): Expected(num_samples=s.num_samples, num_bytes=s.num_bytes, sha256=s.sha256, first_id=offsets[s.name]) for s in manifest.shards(split)}


def _read_stages(source: Any, manifest: Manifest, split: str, cfg: TrainConfig, skips: Skips) -> list[Any]:
    """Shard URLs -> samples with ids, each shard checked against the manifest."""
    return [source, bind(tar_samples, policy=skips.shards.policy, expected=expected(manifest, split), verify_hashes=cfg.verify_hashes, failures=skips.shards)]


def _num_workers(cfg: TrainConfig) -> int:
    return max(1, cfg.num_loader_workers_per_rank)


def _loader(stages: list[Any], cfg: TrainConfig, world: World, *, partial: bool, skips: Skips | None = None) -> Iterable[Batch]:
    """A DataLoader over the stages then batching (`partial`: keep a short last batch), its
    batches handed over in reused shared-memory blocks (raywds.blocks), each carrying what
    `skips` skipped before it."""
    # Workers start afresh each epoch (the pipeline is seeded by epoch), so start them by fork
    # where the OS has it: a process that was itself spawned would otherwise spawn its workers
    # too and re-import torch in each, seconds per epoch. Workers only decode on the CPU.
    workers = cfg.num_loader_workers_per_rank
    context = "fork" if workers and "fork" in multiprocessing.get_all_start_methods() else None
    blocks = Blocks(workers)
    batched = wds.batched(cfg.batch_size_per_rank, collation_fn=bind(collate, out_of=blocks.take), partial=partial)
    loader = DataLoader(
        wds.DataPipeline(*stages, batched, *([skips.attach] if skips is not None else []), blocks.leased),
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
    """Refuse, before any step, a plan that would hang or lose data; log its warnings."""
    findings = planner.check(plan, num_shards=len(manifest.shards("train")))
    refused = planner.refusals(findings)
    if refused:
        raise ConfigError(refused[0])
    for finding in findings:
        if finding.level == "warn":
            log.warning("%s", finding.text)


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
    skips = Skips(read_policy(cfg, skip_unreadable=plan.mode == "resample"))
    stages = [
        *_read_stages(source, manifest, "train", cfg, skips),
        bind(unconsumed, consumed=consumed),
        bind(worker_shuffled, buffer=cfg.shuffle_buffer_samples, seed=cfg.seed, epoch=epoch, rank=rank),
        bind(decoded, decode=train_decoder(cfg), skips=skips),
    ]
    loader = _loader(stages, cfg, world, partial=plan.mode == "split", skips=skips)
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
    skips = Skips(read_policy(cfg, skip_unreadable=False))
    stages = [
        *_read_stages(bind(slot_urls, slots, world.rank, manifest), manifest, "val", cfg, skips),
        bind(decoded, decode=val_decoder(cfg), skips=skips),
    ]
    return _loader(stages, cfg, world, partial=True)
