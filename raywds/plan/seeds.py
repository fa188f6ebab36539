"""The seed strings of every random stream in an epoch, in one place: the loader and the
shuffle replay (`raywds plan --shuffle-report`) both build theirs here, so the replay draws
what training draws.

A stream's seed is its tag and its parts joined by `-`, e.g. `resample-0-3-1-0` for the shard
draws of seed 0, epoch 3, rank 1, worker 0. The tags' values are part of every seeded run:
changing one changes what a given `--seed` trains on.
"""

from __future__ import annotations

import hashlib
import random

SHARD_DRAWS = "resample"
"""Resample mode: the shards a (rank, worker) draws with replacement."""
SHARD_ORDER = "split"
"""Split mode: the epoch's shard order before dealing (on each node, with --canonical-nodes)."""
CANONICAL = "canonical"
"""Split mode with --canonical-nodes: the run's shards, in the order dealt to its canonical nodes."""
WORKER_SHUFFLE = "shuffle"
"""The sample shuffle inside each loader worker."""
CROSS_SHUFFLE = "cross"
"""The main process's shuffle across a rank's workers (and the Ray Data plane's shuffle on each rank)."""
PLANE_SHUFFLE = "plane"
"""The Ray Data plane's shuffle of the encoded samples inside each read task, per (seed, epoch,
rank, round of draws, task)."""
CROP = "crop"
"""A training sample's random crop and flip, per (seed, epoch, sample id): the same crop
whichever loader worker, rank or Ray Data task decodes the sample, in whatever order."""
AUGMENT = "augment"
"""A training crop's augmentations (--auto-augment, --random-erase), per (seed, epoch, sample id),
drawn apart from the crop's: turning them on changes no crop."""
MIX = "mix"
"""A training batch's mixup or cutmix, per (seed, epoch, the batch's first sample id)."""


def seed(tag: str, *parts: object) -> str:
    """The seed string of one stream."""
    return "-".join(str(p) for p in (tag, *parts))


def rng(tag: str, *parts: object) -> random.Random:
    """A generator private to one stream."""
    return random.Random(seed(tag, *parts))


def number(tag: str, *parts: object) -> int:
    """The seed of one stream as a non-negative 63-bit integer, for generators seeded by numbers
    (torch's, Ray Data's shuffle): the first 8 bytes of the seed string's BLAKE2b, so nothing
    depends on Python's per-process string hashing."""
    digest = hashlib.blake2b(seed(tag, *parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
