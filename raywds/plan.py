"""The planner: which shards, samples and batches each rank and DataLoader worker gets in an
epoch, and whether that plan is safe. The loaders read the same plan, so what it prints is
what training does.

    raywds plan --data shards/ --nodes 4 --gpus-per-node 8 --workers 8 --batch-size 256 --mode split
    raywds plan --num-shards 1282 --samples-per-shard 1000 --nodes 64 --gpus-per-node 8 --workers 6

split: shards shuffled by (seed, epoch) and dealt by sample count to the R ranks, then each
rank's to its W DataLoader workers; each rank's batches are ceil(samples / B), the last one partial (a last batch
of one sample is folded into the one before: BatchNorm cannot train on a single sample).
resample: every rank takes the same number of full batches, ceil(N / (R x B)) unless set.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Literal

from raywds.shards import ShardInfo, deal, shardsum

Level = Literal["refuse", "warn", "note"]


@dataclass(frozen=True)
class Finding:
    """One line of the verdict: `refuse` stops training before it starts."""

    level: Level
    text: str


def split_batches(num_samples: int, batch_size: int) -> int:
    """Batches a rank takes from `num_samples` in split mode: full ones, then the partial rest,
    except that a rest of one sample joins the batch before it."""
    batches = math.ceil(num_samples / batch_size)
    if batches > 1 and num_samples % batch_size == 1:
        batches -= 1
    return batches


@dataclass(frozen=True)
class EpochPlan:
    """One epoch for the whole job, the same on every rank (all inputs are shared and seeded)."""

    mode: str
    num_ranks: int
    num_workers: int
    """Slots per rank: DataLoader workers, or 1 when the main process reads."""
    batch_size: int
    num_samples: int
    """Samples in the split (the manifest's count)."""
    samples_per_rank: list[int]
    """Samples each rank trains on this epoch (what is left of it, when resuming)."""
    batches_per_rank: list[int]
    slots: list[list[ShardInfo]]
    """split: the shards of slot rank x num_workers + worker, `num_samples` being what is left to read."""
    resumed: bool = False

    def slot(self, rank: int, worker: int) -> list[ShardInfo]:
        return self.slots[rank * self.num_workers + worker]

    @property
    def min_batches(self) -> int:
        """Steps every rank takes: the last point where all ranks are still in the loop."""
        return min(self.batches_per_rank)

    @property
    def max_batches(self) -> int:
        return max(self.batches_per_rank)


def split_plan(
    shards: list[ShardInfo], *, num_ranks: int, num_workers: int, batch_size: int, seed: int, epoch: int,
    num_samples: int | None = None, resumed: bool = False,
) -> EpochPlan:  # fmt: skip
    """Deal `shards` (num_samples = samples still to read) to the slots, shuffled by (seed, epoch)."""
    order = [s for s in shards if s.num_samples > 0]
    random.Random(f"split-{seed}-{epoch}").shuffle(order)
    # Ranks first, then each rank's shards to its workers: ranks wait on each other at every
    # step, so their balance matters most; workers of one rank only share its queue.
    slots = [slot for rank_shards in deal(order, num_ranks) for slot in deal(rank_shards, num_workers)]
    per_rank = [
        sum(s.num_samples for slot in slots[r * num_workers : (r + 1) * num_workers] for s in slot) for r in range(num_ranks)
    ]
    return EpochPlan(
        mode="split", num_ranks=num_ranks, num_workers=num_workers, batch_size=batch_size,
        num_samples=sum(s.num_samples for s in shards) if num_samples is None else num_samples,
        samples_per_rank=per_rank, batches_per_rank=[split_batches(n, batch_size) for n in per_rank],
        slots=slots, resumed=resumed,
    )  # fmt: skip


def resample_plan(
    num_samples: int, *, num_ranks: int, num_workers: int, batch_size: int,
    batches_per_epoch: int | None = None, samples_done: int = 0,
) -> EpochPlan:  # fmt: skip
    """Equal full batches on every rank: ceil((N - samples done) / (R x B)), or `batches_per_epoch`."""
    if batches_per_epoch is None:
        batches = math.ceil(max(num_samples - samples_done, 0) / (num_ranks * batch_size))
    else:
        batches = max(batches_per_epoch - samples_done // (num_ranks * batch_size), 0)
    return EpochPlan(
        mode="resample", num_ranks=num_ranks, num_workers=num_workers, batch_size=batch_size, num_samples=num_samples,
        samples_per_rank=[batches * batch_size] * num_ranks, batches_per_rank=[batches] * num_ranks,
        slots=[], resumed=samples_done > 0,
    )  # fmt: skip


def remaining(shards: list[ShardInfo], consumed_per_shard: list[int]) -> list[ShardInfo]:
    """The shards with `num_samples` reduced to what an interrupted epoch has not yet delivered."""
    return [dataclasses.replace(s, num_samples=s.num_samples - done) for s, done in zip(shards, consumed_per_shard)]


def check(plan: EpochPlan, *, num_shards: int) -> list[Finding]:
    """The verdict: settings that would hang or lose data are `refuse`, with the fix."""
    found: list[Finding] = []
    slots = plan.num_ranks * plan.num_workers
    share = plan.num_samples / plan.num_ranks
    if plan.batch_size > share and not plan.resumed:
        found.append(Finding("warn", (
            f"batch {plan.batch_size} per rank is more than a rank's share of the data ({plan.num_samples} samples / "
            f"{plan.num_ranks} ranks = {share:.0f}): every epoch is {plan.max_batches} step(s) per rank"
            + (", so samples repeat within each batch" if plan.mode == "resample" else " of a partial batch")
            + f"; use --batch-size {max(int(share), 1)} or less"
        )))  # fmt: skip
    if plan.mode == "split":
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
    else:
        drawn = sum(plan.samples_per_rank)
        coverage = 1 - math.exp(-drawn / max(plan.num_samples, 1))
        found.append(Finding("note", (
            f"every rank takes {plan.max_batches} full batches; {drawn} draws over {plan.num_samples} samples reach "
            f"about {100 * coverage:.0f}% of them (samples repeat or are missed; --mode split gives exact epochs)"
        )))  # fmt: skip
    return found


def refusals(findings: list[Finding]) -> list[str]:
    return [f.text for f in findings if f.level == "refuse"]


def verdict(findings: list[Finding]) -> str:
    refused = refusals(findings)
    if refused:
        return "REFUSED: " + refused[0]
    warned = [f.text for f in findings if f.level == "warn"]
    return "OK, but " + warned[0] if warned else "OK"


def render(plan: EpochPlan, findings: list[Finding], *, gpus_per_node: int, max_ranks_shown: int = 16) -> str:
    """The planner's report: one row per rank, the shards each worker opens, then the verdict."""
    lines = [
        f"{plan.mode} mode: {plan.num_ranks} ranks x {plan.num_workers} loader workers, batch {plan.batch_size} per rank, "
        f"{plan.num_samples} samples",
        f"{'rank':>5} {'node':>5} {'shards':>7} {'samples':>8} {'batches':>8} {'last batch':>11}",
    ]
    shown = list(range(plan.num_ranks)) if plan.num_ranks <= max_ranks_shown else [*range(max_ranks_shown // 2), *range(plan.num_ranks - max_ranks_shown // 2, plan.num_ranks)]
    for i, rank in enumerate(shown):
        if i and rank != shown[i - 1] + 1:
            lines.append(f"{'...':>5}")
        samples, batches = plan.samples_per_rank[rank], plan.batches_per_rank[rank]
        if plan.mode == "split":
            num_shards = str(sum(len(plan.slot(rank, w)) for w in range(plan.num_workers)))
            last = samples - (batches - 1) * plan.batch_size if batches else 0
        else:
            num_shards, last = "random", plan.batch_size if batches else 0
        lines.append(f"{rank:>5} {rank // gpus_per_node:>5} {num_shards:>7} {samples:>8} {batches:>8} {last:>11}")
    if plan.mode == "split":
        lines.append("shards each worker opens:")
        for rank in shown[:2]:
            for worker in range(plan.num_workers):
                names = shardsum(sorted(s.name for s in plan.slot(rank, worker)))
                more = f" ... ({len(plan.slot(rank, worker))} shards)" if len(names) > 6 else ""
                lines.append(f"  rank {rank} worker {worker}: " + (" ".join(names[:6]) + more if names else "(none)"))
    else:
        per_worker = plan.max_batches * plan.batch_size / plan.num_workers
        lines.append(f"shards each worker opens: drawn at random with replacement, seeded by (seed, epoch, rank, worker), about {per_worker:.0f} samples per worker")
    for f in findings:
        lines.append(f"{f.level}: {f.text}")
    lines.append("verdict: " + verdict(findings))
    return "\n".join(lines)
