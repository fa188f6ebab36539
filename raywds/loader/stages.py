"""The loader's stages, each a generator over the one before, so any of them can be fed a
plain list: shard URLs for a (rank, worker), samples not yet consumed, the worker's shuffle,
decoding (bad samples to `Skips`), batches, and the main process's rebatching.

Workers batch their own samples; the main process can unbatch, shuffle across workers and
rebatch (`cross_worker_shuffle_buffer`), as WebLoader's unbatched().shuffle(n).batched(b).
Every batch carries its samples' ids and keys, so the loop knows what it trained on.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterable, Iterator
from functools import partial as bind
from typing import Any, NamedTuple

import numpy as np
import torch
import webdataset as wds

from raywds.errors import ConfigError, DataError
from raywds.loader import crops, decodings
from raywds.loader.augment import Augment
from raywds.loader.blocks import Slots
from raywds.loader.clock import Spent
from raywds.loader.decodings import decoding
from raywds.loader.labels import Labels, MemberError
from raywds.loader.pool import current_worker
from raywds.loader.readers import Failures, ReadPolicy
from raywds.loader.settings import LoaderConfig
from raywds.plan import seeds

log = logging.getLogger(__name__)


class BadSample(NamedTuple):
    """A sample that could not be used, as the loader worker that met it says: (shard, key) is
    the sample, whichever worker or rank draws it again, so draws of it count as one."""

    shard: str
    key: str
    member: str
    """The member that failed (`KEY.jpg`), or `KEY.*` where none could be picked."""
    reason: str

    @property
    def line(self) -> str:
        return f"shard {self.shard}: sample {self.key} ({self.member}): {self.reason}"


class Batch(NamedTuple):
    images: torch.Tensor | decodings.Encoded
    """uint8 NCHW, or (`--decode device`) the JPEG bytes and crops the device decodes."""
    labels: torch.Tensor
    ids: torch.Tensor
    """Each sample's id: its shard's offset in manifest order plus its place in the shard."""
    keys: list[str]
    """Each sample's `__key__` in its tar."""
    bad_samples: tuple[BadSample, ...] = ()
    """resample mode: each sample skipped since the worker's previous batch, and why."""
    bad_shards: tuple[str, ...] = ()
    """resample mode: why each shard skipped since the worker's previous batch could not be read."""
    read_retries: int = 0
    """Shard reads retried (and resumed) since the worker's previous batch."""
    spent: Spent | None = None
    """What the worker spent reading, decoding and collating since its previous batch."""


Sample = tuple[Any, int, int, str]

Decoder = Callable[..., Any]
"""A sample's image bytes and id (and `out=`, a batch's slot, where the decoding fills one) ->
what its batch carries (raywds.loader.crops)."""


def train_decoder(cfg: LoaderConfig, epoch: int) -> Decoder:
    """`--decode`'s training crop, each sample's drawn from its own generator (crops.crop_rng),
    then its augmentations (raywds.loader.augment), drawn from another."""
    crop = decoding(cfg.decode).train_crop(cfg.crop_size, (cfg.crop_scale_min, 1.0))
    augment = Augment.of(cfg)
    if augment is not None:
        return bind(_augmented, crop, augment, cfg.seed, epoch)
    return bind(_seeded, crop, cfg.seed, epoch)


def _seeded(crop: Callable[..., Any], seed: int, epoch: int, data: bytes, sample_id: int, **out: Any) -> Any:
    return crop(data, rng=crops.crop_rng(seed, epoch, sample_id), **out)


def _augmented(
    crop: Callable[..., Any], augment: Augment, seed: int, epoch: int, data: bytes, sample_id: int, **out: Any
) -> Any:
    """The crop, augmented; written back into its batch slot (`out`) where it has one."""
    image = augment(_seeded(crop, seed, epoch, data, sample_id, **out), seed=seed, epoch=epoch, sample_id=sample_id)
    return image if not out else out["out"].copy_(image)


def val_decoder(cfg: LoaderConfig) -> Decoder:
    """The validation centre crop (no randomness: the sample id is not needed)."""
    return bind(_unseeded, decoding(cfg.decode).val_crop(cfg.val_crop_size, cfg.val_resize_size))


def _unseeded(fn: Callable[..., Any], data: bytes, sample_id: int, **out: Any) -> Any:
    return fn(data, **out)


class SampleError(DataError):
    """One sample cannot be used; the message names its shard, key and member."""

    def __init__(self, bad: BadSample | str):
        # text alone where torch's DataLoader raises a worker's error again in the training process
        super().__init__(bad if isinstance(bad, str) else bad.line)
        self.bad = bad if isinstance(bad, BadSample) else None


MAX_LOGGED = 5
"""Bad samples a loader worker logs in full per epoch; the rest are only counted."""


class Skips:
    """A loader worker's policy for bad samples and unreadable shards: raise (exact passes), or
    skip, log the first few and hand the reasons on with the worker's next batch (resample)."""

    def __init__(self, policy: ReadPolicy):
        self.shards = Failures(policy)
        self.samples: list[BadSample] = []
        self.num_logged = 0
        self.shards_sent = 0
        self.retries_sent = 0

    def bad_sample(self, error: SampleError) -> None:
        if not self.shards.policy.skip_unreadable:
            raise error
        assert error.bad is not None, "a worker's own SampleError names its sample"
        self.samples.append(error.bad)
        if self.num_logged < MAX_LOGGED:
            self.num_logged += 1
            log.warning("skipped a bad sample: %s", error)

    def attach(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """Stage: each batch carries what was skipped since the previous one."""
        for batch in batches:
            shards = self.shards.skipped[self.shards_sent :]
            self.shards_sent += len(shards)
            samples, self.samples = self.samples, []
            retries, self.retries_sent = self.shards.retries - self.retries_sent, self.shards.retries
            if samples or shards or retries:
                batch = batch._replace(bad_samples=tuple(samples), bad_shards=tuple(shards), read_retries=retries)
            yield batch


def _what(e: BaseException) -> str:
    """A decoder's complaint in one line (torchvision's carry a C++ file and line first)."""
    text = (str(e).splitlines() or [""])[0] or type(e).__name__
    text = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", text)  # PIL names the buffer it read
    return text.rsplit(".cpp:", 1)[-1].split(", ", 1)[-1] if ".cpp:" in text else text


def decoded(
    samples: Iterable[dict[str, Any]],
    decode: Decoder,
    skips: Skips,
    slots: Slots | None = None,
    labels: Labels | None = None,
) -> Iterator[Sample]:
    """Sample dicts -> (image, class index, id, key), the image as `decode` (raywds.loader.crops) makes
    it, in the next of `slots` when given; a sample without an image or class, or whose image or
    class cannot be read, goes to `skips`. `labels` says which members hold them (default: .cls)."""
    labels = labels or Labels()
    for sample in samples:
        key, url = sample["__key__"], sample["__url__"]
        member = f"{key}.*"
        try:
            ext, label = labels.read(sample)
            member = f"{key}.{ext}"
            slot = slots.next() if slots is not None else None
            image = decode(sample[ext], sample["__id__"], **({} if slot is None else {"out": slot}))
        except Exception as e:  # noqa: BLE001 - PIL, libjpeg and torchvision raise many types for bad bytes
            member = f"{key}.{e.member}" if isinstance(e, MemberError) else member
            skips.bad_sample(SampleError(BadSample(url, key, member, _what(e))))
            continue
        if slots is not None and slot is not None:
            slots.filled()
        yield image, label, sample["__id__"], key


def _worker() -> tuple[int, int]:
    return current_worker() or (0, 1)


def worker_urls(urls: list[list[str]], rank: int) -> Iterator[dict[str, str]]:
    """The shard URLs of this rank's current DataLoader worker: `urls` holds one list per worker
    of the rank (its slot, or its draws), so no worker is handed the plan or the shard list."""
    worker, num_workers = _worker()
    if worker >= len(urls):
        raise ConfigError(
            f"rank {rank}, worker {worker} of {num_workers}: only {len(urls)} slots were dealt to the rank"
        )
    for url in urls[worker]:
        yield {"url": url}


def unconsumed(
    samples: Iterable[dict[str, Any]], left_out: dict[str, tuple[int, np.ndarray]]
) -> Iterator[dict[str, Any]]:
    """Drop the samples an interrupted epoch already trained on: `left_out` holds, by shard URL,
    the shard's first id and a flag per sample, for the shards it partly trained on."""
    for sample in samples:
        done = left_out.get(sample["__url__"])
        if done is None or not done[1][sample["__id__"] - done[0]]:
            yield sample


def shuffled(src: Iterable[Any], *, buffer: int, rng: random.Random) -> Iterator[Any]:
    """Shuffle through a buffer of `buffer` items (webdataset's shuffle); 0 passes through."""
    if buffer <= 1:
        return iter(src)
    return wds.shuffle(buffer, min(buffer, 100), rng=rng)(iter(src))


def worker_shuffled(src: Iterable[Any], *, buffer: int, seed: int, epoch: int, rank: int) -> Iterator[Any]:
    """Sample shuffle inside a DataLoader worker, seeded per (seed, epoch, rank, worker)."""
    worker, _ = _worker()
    return shuffled(src, buffer=buffer, rng=seeds.rng(seeds.WORKER_SHUFFLE, seed, epoch, rank, worker))


def collate(
    samples: list[Sample],
    out_of: crops.OutOf | None = None,
    *,
    bad_samples: tuple[BadSample, ...] = (),
    bad_shards: tuple[str, ...] = (),
) -> Batch:
    """Samples -> a Batch; in a worker, the images go into shared memory (`out_of`: raywds.loader.blocks)."""
    images, labels, ids, keys = zip(*samples)
    return Batch(
        decodings.stack(list(images), out_of),
        torch.as_tensor(labels, dtype=torch.long),
        torch.as_tensor(ids, dtype=torch.long),
        list(keys),
        bad_samples,
        bad_shards,
    )


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
        yield collate(
            [*_samples(a), *_samples(b)],
            bad_samples=a.bad_samples + b.bad_samples,
            bad_shards=a.bad_shards + b.bad_shards,
        )
    else:
        yield from held


def _samples(batch: Batch) -> list[Sample]:
    """The batch's samples again (image views, not copies; a `device` batch's JPEG bytes and crops),
    labels and ids as plain ints read once, not four tensor indexings a sample."""
    return list(zip(batch.images, batch.labels.tolist(), batch.ids.tolist(), batch.keys))


def rebatched(
    batches: Iterable[Batch], *, batch_size: int, buffer: int, rng: random.Random, partial: bool
) -> Iterator[Batch]:
    """Main process: unbatch the workers' batches, shuffle across workers, batch again; what the
    workers skipped travels on with the next batch out."""
    skipped: tuple[list[BadSample], list[str]] = ([], [])
    retries = [0]
    spent = [Spent()]

    def unbatched() -> Iterator[Sample]:
        for batch in batches:
            skipped[0].extend(batch.bad_samples)
            skipped[1].extend(batch.bad_shards)
            retries[0] += batch.read_retries
            if batch.spent is not None:
                spent[0] = spent[0].plus(batch.spent)
            yield from _samples(batch)

    def collated(samples: list[Sample]) -> Batch:
        batch = collate(samples, bad_samples=tuple(skipped[0]), bad_shards=tuple(skipped[1]))
        batch = batch._replace(read_retries=retries[0], spent=spent[0])
        skipped[0].clear()
        skipped[1].clear()
        retries[0] = 0
        spent[0] = Spent()
        return batch

    out = wds.batched(batch_size, collation_fn=collated, partial=partial)(shuffled(unbatched(), buffer=buffer, rng=rng))
    return fold_single_tail(out) if partial else out
