"""resample: every loader worker of every rank draws shards uniformly with replacement, seeded
by (seed, epoch, rank, worker); every rank takes ceil(N / (R x B)) full batches, so
collectives never wait on a missing batch. Samples may repeat or be missed within an epoch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from raywds.data.columns import sample_counts
from raywds.data.manifest import ShardInfo
from raywds.errors import DataError
from raywds.plan import seeds
from raywds.plan.epoch import Done, EpochPlan, Finding, Mode, Nodes, WorkerShards

T = TypeVar("T")


@dataclass(frozen=True)
class Resample(Mode):
    name: ClassVar[str] = "resample"
    exact: ClassVar[bool] = False

    def plan(
        self,
        shards: Sequence[ShardInfo],
        *,
        num_ranks: int,
        num_workers: int,
        batch_size: int,
        seed: int = 0,
        epoch: int = 0,
        batches_per_epoch: int | None = None,
        done: Done | None = None,
        nodes: Nodes | None = None,
    ) -> EpochPlan:
        """Equal full batches on every rank: ceil((N - samples done) / (R x B)), or `batches_per_epoch`."""
        num_samples = int(sample_counts(shards).sum())
        already = done.samples if done is not None else 0
        if batches_per_epoch is None:
            batches = math.ceil(max(num_samples - already, 0) / (num_ranks * batch_size))
        else:
            batches = max(batches_per_epoch - already // (num_ranks * batch_size), 0)
        return EpochPlan(
            mode=self,
            num_ranks=num_ranks,
            num_workers=num_workers,
            batch_size=batch_size,
            num_samples=num_samples,
            samples_per_rank=[batches * batch_size] * num_ranks,
            batches_per_rank=[batches] * num_ranks,
            slots=WorkerShards([], num_workers),
            resumed=already > 0,
        )

    def shards_for(
        self,
        plan: EpochPlan,
        shards: Sequence[ShardInfo],
        *,
        rank: int,
        worker: int,
        seed: int,
        epoch: int,
        reseed: int = 0,
    ) -> Iterator[ShardInfo]:
        """Drawn uniformly with replacement, forever, seeded per (seed, epoch, rank, worker)."""
        parts = (seed, epoch, rank, worker) if not reseed else (seed, epoch, reseed, rank, worker)
        rng = seeds.rng(seeds.SHARD_DRAWS, *parts)
        while True:
            yield rng.choice(shards)

    def epoch_batches(self, batches: Iterable[T], plan: EpochPlan, rank: int) -> Iterator[T]:
        wanted, taken = plan.batches_per_rank[rank], 0
        for batch in itertools.islice(batches, wanted):
            taken += 1
            yield batch
        if taken < wanted:  # every rank takes `wanted`: one short would leave the others waiting
            raise DataError(
                f"rank {rank}: its loader workers' shard draws ran out after {taken} of {wanted} batches "
                "(more samples were skipped than the draws leave room for)"
            )

    def findings(self, plan: EpochPlan, *, num_shards: int) -> list[Finding]:
        drawn = sum(plan.samples_per_rank)
        coverage = 1 - math.exp(-drawn / max(plan.num_samples, 1))
        return [
            *_read_ahead(plan),
            Finding(
                "note",
                (
                    f"every rank takes {plan.max_batches} full batches; "
                    f"{drawn} draws over {plan.num_samples} samples reach about {100 * coverage:.0f}% of them "
                    "(samples repeat or are missed; --mode split gives exact epochs)"
                ),
            ),
        ]

    def rank_columns(self, plan: EpochPlan, rank: int) -> tuple[str, int]:
        return "random", plan.batch_size if plan.batches_per_rank[rank] else 0

    def worker_lines(self, plan: EpochPlan, ranks: list[int]) -> list[str]:
        per_worker = plan.max_batches * plan.batch_size / plan.num_workers
        return [
            "shards each worker opens: drawn at random with replacement, seeded by (seed, epoch, rank, worker), "
            f"about {per_worker:.0f} samples per worker"
        ]


PREFETCH = 2
"""Batches each DataLoader worker decodes ahead (torch's default prefetch_factor)."""


def _read_ahead(plan: EpochPlan) -> list[Finding]:
    """A warning when the workers decode several times what the epoch takes: each of a rank's
    workers decodes PREFETCH batches ahead, and an epoch of few batches per rank leaves most of
    them unused (split mode reads each sample once, so it has no such waste)."""
    if plan.num_workers < 2 or not plan.max_batches:
        return []
    decoded = (plan.max_batches + PREFETCH * plan.num_workers) / plan.max_batches  # of what the epoch takes
    if decoded < 3:
        return []
    return [
        Finding(
            "warn",
            (
                f"the loader workers decode about {decoded:.0f}x what the "
                f"epoch takes: each of a rank's {plan.num_workers} workers decodes {PREFETCH} batches ahead, and a "
                f"rank takes {plan.max_batches} per epoch; use fewer --loader-workers, a smaller --batch-size, "
                "or --mode split"
            ),
        )
    ]
