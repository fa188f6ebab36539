"""The seed strings of every random stream in an epoch, in one place: the loader and the
shuffle replay (`raywds plan --shuffle-report`) both build theirs here, so the replay draws
what training draws.

A stream's seed is its tag and its parts joined by `-`, e.g. `resample-0-3-1-0` for the shard
draws of seed 0, epoch 3, rank 1, worker 0. The tags' values are part of every seeded run:
changing one changes what a given `--seed` trains on.
"""

from __future__ import annotations

import random

SHARD_DRAWS = "resample"
"""Resample mode: the shards a (rank, worker) draws with replacement."""
SHARD_ORDER = "split"
"""Split mode: the epoch's shard order before dealing."""
WORKER_SHUFFLE = "shuffle"
"""The sample shuffle inside each loader worker."""
CROSS_SHUFFLE = "cross"
"""The main process's shuffle across a rank's workers."""


def seed(tag: str, *parts: object) -> str:
    """The seed string of one stream."""
    return "-".join(str(p) for p in (tag, *parts))


def rng(tag: str, *parts: object) -> random.Random:
    """A generator private to one stream."""
    return random.Random(seed(tag, *parts))
