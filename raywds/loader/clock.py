"""Where a loader worker's time goes: reading shards (network or storage, the bytes and the
seconds), decoding (with the crop and resize), and collating the batch into shared memory.
Each batch carries what its worker spent since its previous batch (`Spent`), so the training
loop adds up a rank's loader without asking its workers (raywds.train.doctor reads the sums).

    clock = Clock()
    stages = [urls, tar_samples, clock.reading, ..., bind(decoded, timed=clock.decoding), ...]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


class Spent(NamedTuple):
    """A loader's seconds and bytes over some batches (summed with `plus`)."""

    read_s: float = 0.0
    """Seconds the worker waited for shard bytes (opening, streaming, a prefetch not yet done)."""
    decode_s: float = 0.0
    """Seconds decoding, cropping and resizing images."""
    collate_s: float = 0.0
    """Seconds stacking samples into a batch (in shared memory)."""
    read_bytes: int = 0
    samples: int = 0
    """Samples decoded."""
    slow_shard: str = ""
    """The shard read slowest (fewest bytes a second) among those finished."""
    slow_shard_s: float = 0.0
    slow_shard_bytes: int = 0
    ready_at: float = 0.0
    """When the batch was made (the host's wall clock: a rank's workers share its host); the
    training loop takes what it waited beyond that as the hand-over."""
    plane: bool = False
    """Made by the Ray Data plane's tasks, on any node (raywds.loader.plane): no hand-over clock."""
    resize_s: float = 0.0
    """Of decode_s, the seconds resizing the crops (`RESIZING`; 0 where the decoder does not
    resize apart: `--decode pil`'s reference transform)."""
    shards: int = 0
    """Shards begun (their first sample read)."""

    def plus(self, other: Spent) -> Spent:
        slow = self if _rate(self) <= _rate(other) else other
        return Spent(
            self.read_s + other.read_s,
            self.decode_s + other.decode_s,
            self.collate_s + other.collate_s,
            self.read_bytes + other.read_bytes,
            self.samples + other.samples,
            slow.slow_shard,
            slow.slow_shard_s,
            slow.slow_shard_bytes,
            max(self.ready_at, other.ready_at),
            self.plane or other.plane,
            self.resize_s + other.resize_s,
            self.shards + other.shards,
        )

    @property
    def busy_s(self) -> float:
        return self.read_s + self.decode_s + self.collate_s


def _rate(spent: Spent) -> float:
    """The slow shard's bytes a second (infinite when none is named)."""
    if not spent.slow_shard:
        return float("inf")
    return spent.slow_shard_bytes / max(spent.slow_shard_s, 1e-9)


class Part:
    """The seconds of one part of a timed stage, added up where the part runs and taken by the
    stage's clock: the crop's resize inside decoding (raywds.loader.crops)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        started = time.perf_counter()
        try:
            return work(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


RESIZING = Part()
"""This process's seconds resizing crops since `Clock.decoding` last took them."""

MIN_SHARD_S = 0.05
"""A shard read faster than this is never named as the slow one (timer noise, not a cause)."""


class Clock:
    """One loader worker's running totals; `taken` hands over what was spent since the last call."""

    def __init__(self) -> None:
        self.read_s = self.decode_s = self.collate_s = self.resize_s = 0.0
        self.read_bytes = self.samples = self.shards = 0
        self.slow = ("", 0.0, 0)
        self._shard = ("", 0.0, 0)  # the shard being read: url, seconds, bytes

    def reading(
        self, samples: Iterable[dict[str, Any]], sizes: dict[str, int] | None = None
    ) -> Iterator[dict[str, Any]]:
        """Stage: samples as read, the time spent getting each counted to its shard; `sizes`:
        each shard's bytes by URL (else the bytes of its samples' members are counted)."""
        sizes = sizes or {}
        it = iter(samples)
        while True:
            started = time.perf_counter()
            sample = next(it, None)
            spent = time.perf_counter() - started
            self.read_s += spent
            if sample is None:
                self._finish_shard()
                return
            url = sample.get("__url__", "")
            name, seconds, num_bytes = self._shard
            if url != name:
                self._finish_shard()
                name, seconds, num_bytes = url, 0.0, 0
                self.shards += 1
            whole = sizes.get(url)
            if whole is None:
                size = sum(len(v) for v in sample.values() if isinstance(v, bytes | bytearray | memoryview))
            else:
                size = whole if not num_bytes else 0  # the whole shard, counted at its first sample
            self.read_bytes += size
            self._shard = (name, seconds + spent, num_bytes + size)
            yield sample

    def _finish_shard(self) -> None:
        name, seconds, num_bytes = self._shard
        if name and seconds >= MIN_SHARD_S:
            slow_name, slow_s, slow_bytes = self.slow
            if not slow_name or num_bytes / seconds < slow_bytes / max(slow_s, 1e-9):
                self.slow = (name, seconds, num_bytes)
        self._shard = ("", 0.0, 0)

    def decoding(self, decode: Callable[..., T], data: bytes, sample_id: int, **out: Any) -> T:
        RESIZING.take()  # resizes timed outside a clock are not this sample's
        started = time.perf_counter()
        try:
            return decode(data, sample_id, **out)
        finally:
            self.decode_s += time.perf_counter() - started
            self.resize_s += RESIZING.take()
            self.samples += 1

    def collating(self, collate: Callable[[list[Any]], T], samples: list[Any]) -> T:
        started = time.perf_counter()
        try:
            return collate(samples)
        finally:
            self.collate_s += time.perf_counter() - started

    def attach(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Stage: each batch (a raywds.loader.stages.Batch) carries what was spent since the previous one."""
        for batch in batches:
            yield batch._replace(spent=self.taken())

    def taken(self) -> Spent:
        """What was spent since the last call, then the totals start again."""
        spent = Spent(
            self.read_s,
            self.decode_s,
            self.collate_s,
            self.read_bytes,
            self.samples,
            *self.slow,
            time.time(),
            resize_s=self.resize_s,
            shards=self.shards,
        )
        self.read_s = self.decode_s = self.collate_s = self.resize_s = 0.0
        self.read_bytes = self.samples = self.shards = 0
        self.slow = ("", 0.0, 0)
        return spent
