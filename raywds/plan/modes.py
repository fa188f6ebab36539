"""The two ways an epoch reads the data. A mode owns everything that differs between them:
how the epoch is planned, which shards a loader worker reads, how its batches end, what the
plan's verdict says, and what the replay of the loader draws. Config text names a mode
(`--mode resample|split`); `parse` turns it into one of these objects, and nothing else
compares mode names.

resample: every worker of every rank draws shards with replacement, seeded by (seed, epoch,
rank, worker); every rank takes ceil(N / (R x B)) full batches, so collectives never wait.
split: the shards, shuffled by (seed, epoch), are dealt by sample count to the ranks, then
each rank's to its workers; every sample is seen once per epoch and ranks may take different
batch counts (the loop wraps the epoch in Join).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

from raywds.data.manifest import Manifest, ShardInfo, deal
from raywds.errors import ConfigError
from raywds.plan import seeds
from raywds.plan.epoch import EpochPlan, Finding, remaining, split_batches

if TYPE_CHECKING:
    from raywds.config import TrainConfig
    from raywds.plan.position import Position

T = TypeVar("T")


@dataclass(frozen=True)
class Mode:
    """What differs between modes; `Resample` and `Split` fill it in."""

    name: ClassVar[str]
    exact: ClassVar[bool]
    """Every sample once per epoch: ranks may take different batch counts, a rank's last batch
    may be partial, and a sample or shard that cannot be read is an error, never skipped."""

    def plan(
        self, shards: list[ShardInfo], *, num_ranks: int, num_workers: int, batch_size: int, seed: int = 0,
        epoch: int = 0, batches_per_epoch: int | None = None, position: Position | None = None,
    ) -> EpochPlan:  # fmt: skip
        """The epoch's plan, or of what is left of it after `position` (inside this epoch)."""
        raise NotImplementedError

    def shards_for(self, plan: EpochPlan, shards: list[ShardInfo], *, rank: int, worker: int, seed: int, epoch: int, reseed: int = 0) -> Iterator[ShardInfo]:
        """The shards loader `worker` of `rank` reads, in order; `reseed` (samples already
        done, on resume) starts a fresh stream where the mode draws at random."""
        raise NotImplementedError

    def epoch_batches(self, batches: Iterable[T], plan: EpochPlan, rank: int) -> Iterator[T]:
        """Where a rank's epoch ends in its loader's batches."""
        raise NotImplementedError

    def findings(self, plan: EpochPlan, *, num_shards: int) -> list[Finding]:
        """What the verdict says of this mode's plan (raywds.plan.checks adds the common lines)."""
        raise NotImplementedError

    def rank_columns(self, plan: EpochPlan, rank: int) -> tuple[str, int]:
        """`raywds plan`'s shards and last-batch columns for `rank`."""
        raise NotImplementedError

    def worker_lines(self, plan: EpochPlan, ranks: list[int]) -> list[str]:
        """`raywds plan`'s lines on the shards each loader worker opens."""
        raise NotImplementedError


@dataclass(frozen=True)
class Resample(Mode):
    name: ClassVar[str] = "resample"
    exact: ClassVar[bool] = False

    def plan(
        self, shards: list[ShardInfo], *, num_ranks: int, num_workers: int, batch_size: int, seed: int = 0,
        epoch: int = 0, batches_per_epoch: int | None = None, position: Position | None = None,
    ) -> EpochPlan:  # fmt: skip
        """Equal full batches on every rank: ceil((N - samples done) / (R x B)), or `batches_per_epoch`."""
        num_samples = sum(s.num_samples for s in shards)
        done = position.samples_done if position is not None else 0
        if batches_per_epoch is None:
            batches = math.ceil(max(num_samples - done, 0) / (num_ranks * batch_size))
        else:
            batches = max(batches_per_epoch - done // (num_ranks * batch_size), 0)
        return EpochPlan(
            mode=self, num_ranks=num_ranks, num_workers=num_workers, batch_size=batch_size, num_samples=num_samples,
            samples_per_rank=[batches * batch_size] * num_ranks, batches_per_rank=[batches] * num_ranks,
            slots=[], resumed=done > 0,
        )  # fmt: skip

    def shards_for(self, plan: EpochPlan, shards: list[ShardInfo], *, rank: int, worker: int, seed: int, epoch: int, reseed: int = 0) -> Iterator[ShardInfo]:
        """Drawn uniformly with replacement, forever, seeded per (seed, epoch, rank, worker)."""
        parts = (seed, epoch, rank, worker) if not reseed else (seed, epoch, reseed, rank, worker)
        rng = seeds.rng(seeds.SHARD_DRAWS, *parts)
        while True:
            yield rng.choice(shards)

    def epoch_batches(self, batches: Iterable[T], plan: EpochPlan, rank: int) -> Iterator[T]:
        return itertools.islice(batches, plan.batches_per_rank[rank])

    def findings(self, plan: EpochPlan, *, num_shards: int) -> list[Finding]:
        drawn = sum(plan.samples_per_rank)
        coverage = 1 - math.exp(-drawn / max(plan.num_samples, 1))
        return [Finding("note", (
            f"every rank takes {plan.max_batches} full batches; {drawn} draws over {plan.num_samples} samples reach "
            f"about {100 * coverage:.0f}% of them (samples repeat or are missed; --mode split gives exact epochs)"
        ))]  # fmt: skip

    def rank_columns(self, plan: EpochPlan, rank: int) -> tuple[str, int]:
        return "random", plan.batch_size if plan.batches_per_rank[rank] else 0

    def worker_lines(self, plan: EpochPlan, ranks: list[int]) -> list[str]:
        per_worker = plan.max_batches * plan.batch_size / plan.num_workers
        return [f"shards each worker opens: drawn at random with replacement, seeded by (seed, epoch, rank, worker), about {per_worker:.0f} samples per worker"]


@dataclass(frozen=True)
class Split(Mode):
    name: ClassVar[str] = "split"
    exact: ClassVar[bool] = True

    def plan(
        self, shards: list[ShardInfo], *, num_ranks: int, num_workers: int, batch_size: int, seed: int = 0,
        epoch: int = 0, batches_per_epoch: int | None = None, position: Position | None = None,
    ) -> EpochPlan:  # fmt: skip
        """Deal the shards (what is left of them after `position`) to the slots, shuffled by (seed, epoch)."""
        num_samples = sum(s.num_samples for s in shards)
        if position is not None:
            shards = remaining(shards, position.consumed_per_shard(shards))
        order = [s for s in shards if s.num_samples > 0]
        seeds.rng(seeds.SHARD_ORDER, seed, epoch).shuffle(order)
        # Ranks first, then each rank's shards to its workers: ranks wait on each other at every
        # step, so their balance matters most; workers of one rank only share its queue.
        slots = [slot for rank_shards in deal(order, num_ranks) for slot in deal(rank_shards, num_workers)]
        per_rank = [sum(s.num_samples for slot in slots[r * num_workers : (r + 1) * num_workers] for s in slot) for r in range(num_ranks)]
        return EpochPlan(
            mode=self, num_ranks=num_ranks, num_workers=num_workers, batch_size=batch_size, num_samples=num_samples,
            samples_per_rank=per_rank, batches_per_rank=[split_batches(n, batch_size) for n in per_rank],
            slots=slots, resumed=position is not None,
        )  # fmt: skip

    def shards_for(self, plan: EpochPlan, shards: list[ShardInfo], *, rank: int, worker: int, seed: int, epoch: int, reseed: int = 0) -> Iterator[ShardInfo]:
        """The shards dealt to slot rank x workers + worker."""
        if worker >= plan.num_workers or rank >= plan.num_ranks:
            raise ConfigError(f"rank {rank}, worker {worker} is not among the {plan.num_ranks} x {plan.num_workers} slots dealt")
        return iter(plan.slot(rank, worker))

    def epoch_batches(self, batches: Iterable[T], plan: EpochPlan, rank: int) -> Iterator[T]:
        return iter(batches)  # the epoch's own end; the loop checks the count against the manifest

    def findings(self, plan: EpochPlan, *, num_shards: int) -> list[Finding]:
        found: list[Finding] = []
        slots = plan.num_ranks * plan.num_workers
        if not plan.resumed and num_shards < slots:
            found.append(Finding("refuse", (
                f"split mode needs at least one shard per (rank, loader worker): {num_shards} shards < "
                f"{plan.num_ranks} ranks x {plan.num_workers} workers, so {slots - num_shards} workers would "
                f"read nothing; reconvert with a smaller --maxcount (about {max(plan.num_samples // slots, 1)}) "
                f"or use fewer --loader-workers"
            )))  # fmt: skip
        idle = sum(1 for slot in plan.slots if not slot)
        if idle and not plan.resumed and num_shards >= slots:
            found.append(Finding("warn", f"{idle} loader workers get no shard (a few shards are much larger than the rest); smaller shards (--maxcount) keep every worker busy"))
        if plan.min_batches != plan.max_batches:
            late = plan.batches_per_rank.index(plan.max_batches)
            found.append(Finding("note", (
                f"ranks take {plan.min_batches}..{plan.max_batches} batches: a DDP loop without Join would hang at "
                f"step {plan.min_batches + 1} (rank {late} waits for ranks that are done); raywds wraps the epoch in Join"
            )))  # fmt: skip
        busiest, idlest = max(plan.samples_per_rank), min(plan.samples_per_rank)
        if busiest and (busiest - idlest) / busiest > 0.1 and not plan.resumed:
            found.append(Finding("warn", (
                f"ranks are uneven: {idlest}..{busiest} samples, so the least loaded rank idles "
                f"{100 * (busiest - idlest) / busiest:.0f}% of each epoch; more, smaller shards (--maxcount) even it out"
            )))  # fmt: skip
        folded = sum(1 for n in plan.samples_per_rank if n > 1 and n % plan.batch_size == 1)
        if folded:
            found.append(Finding("note", f"{folded} rank(s) end with one spare sample; it joins their previous batch (BatchNorm cannot train on one)"))
        found.append(Finding("note", f"every sample once: {sum(plan.samples_per_rank)} samples this epoch"))
        return found

    def rank_columns(self, plan: EpochPlan, rank: int) -> tuple[str, int]:
        samples, batches = plan.samples_per_rank[rank], plan.batches_per_rank[rank]
        num_shards = sum(len(plan.slot(rank, w)) for w in range(plan.num_workers))
        return str(num_shards), samples - (batches - 1) * plan.batch_size if batches else 0

    def worker_lines(self, plan: EpochPlan, ranks: list[int]) -> list[str]:
        from raywds.data.manifest import shardsum

        lines = ["shards each worker opens:"]
        for rank in ranks[:2]:
            for worker in range(plan.num_workers):
                names = shardsum(sorted(s.name for s in plan.slot(rank, worker)))
                more = f" ... ({len(plan.slot(rank, worker))} shards)" if len(names) > 6 else ""
                lines.append(f"  rank {rank} worker {worker}: " + (" ".join(names[:6]) + more if names else "(none)"))
        return lines


MODES: dict[str, Mode] = {m.name: m for m in (Resample(), Split())}


def parse(name: str) -> Mode:
    """The mode that config text names."""
    if name not in MODES:
        raise ConfigError(f"mode={name!r} is not one of {', '.join(MODES)}")
    return MODES[name]


def loader_slots(cfg: TrainConfig) -> int:
    """Slots per rank: its DataLoader workers, or 1 when the main process reads."""
    return max(1, cfg.num_loader_workers_per_rank)


def epoch_plan(manifest: Manifest, cfg: TrainConfig, num_ranks: int, *, epoch: int, position: Position | None = None) -> EpochPlan:
    """A run's plan for `epoch`, or for what is left of it after `position` (same epoch)."""
    resuming = position is not None and position.epoch == epoch and position.samples_done > 0
    return parse(cfg.mode).plan(
        manifest.shards("train"), num_ranks=num_ranks, num_workers=loader_slots(cfg), batch_size=cfg.batch_size_per_rank,
        seed=cfg.seed, epoch=epoch, batches_per_epoch=cfg.batches_per_epoch, position=position if resuming else None,
    )  # fmt: skip
