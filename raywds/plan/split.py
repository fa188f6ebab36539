"""split: the shards, shuffled by (seed, epoch), are dealt by sample count to the ranks, then
each rank's to its loader workers; every sample is seen once per epoch. Ranks may take
different batch counts: the loop wraps the epoch in Join.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from raywds.data.manifest import NUM_SAMPLES, ShardInfo, deal, shardsum
from raywds.errors import ConfigError
from raywds.plan import seeds
from raywds.plan.epoch import Done, EpochPlan, Finding, Mode, Nodes, WorkerShards, remaining, split_batches

T = TypeVar("T")
SHARDS_PER_RANK = 20
"""Shards per rank that keep split ranks within about 5% of each other (whole shards are dealt)."""


def suggested_maxcount(plan: EpochPlan) -> int:
    """Samples per shard that give every rank SHARDS_PER_RANK shards and every worker one."""
    return max(plan.num_samples // max(SHARDS_PER_RANK * plan.num_ranks, plan.num_ranks * plan.num_workers), 1)


def canonical(shards: Sequence[ShardInfo], count: int, seed: int) -> dict[str, int]:
    """Each shard's canonical node for the run (0..count-1): the shards, shuffled by the seed
    alone, dealt by sample count, so every epoch and every world size agrees."""
    order = list(shards)
    seeds.rng(seeds.CANONICAL, seed).shuffle(order)
    return {s.name: group for group, members in enumerate(deal(order, count)) for s in members}


def node_deal(
    shards: Sequence[ShardInfo], left: list[ShardInfo], num_ranks: int, nodes: Nodes, *, seed: int, epoch: int
) -> list[list[ShardInfo]]:
    """Each rank's shards, kept on their node for the run: the shards `left` of the epoch go to
    the node that holds their canonical node (canonical node c to node c mod the nodes), are
    shuffled there by (seed, epoch, node) and dealt by sample count to its ranks. A node thus
    reads the same shards every epoch (from --cache-dir after the first), in a new order; when
    the nodes change, the canonical nodes are dealt anew to those there are. Still every shard
    once: each is in exactly one canonical node. A world whose ranks do not fill whole nodes
    counts each rank as a node."""
    per_node = nodes.ranks_per_node if num_ranks % nodes.ranks_per_node == 0 else 1
    count = num_ranks // per_node
    home = canonical(shards, nodes.canonical, seed)
    on_node: list[list[ShardInfo]] = [[] for _ in range(count)]
    for s in left:
        if s.num_samples > 0:
            on_node[home[s.name] % count].append(s)
    by_rank = []
    for node, node_shards in enumerate(on_node):
        seeds.rng(seeds.SHARD_ORDER, seed, epoch, node).shuffle(node_shards)
        by_rank += deal(node_shards, per_node)
    return by_rank


@dataclass(frozen=True)
class Split(Mode):
    name: ClassVar[str] = "split"
    exact: ClassVar[bool] = True

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
        """Deal the shards (what is left of them after `done`) to the slots, shuffled by (seed, epoch);
        with `nodes`, each node's own shards to its ranks (node_deal)."""
        shards = list(shards)  # one pass over a manifest's columns (raywds.data.columns)
        num_samples = sum(map(NUM_SAMPLES, shards))
        left = shards
        if done is not None:
            assert done.per_shard is not None, "a split epoch resumes from its per-shard counts"
            left = remaining(shards, done.per_shard)
        if nodes is not None and nodes.canonical > 0:
            by_rank = node_deal(shards, left, num_ranks, nodes, seed=seed, epoch=epoch)
        else:
            order = [s for s in left if s.num_samples > 0]
            seeds.rng(seeds.SHARD_ORDER, seed, epoch).shuffle(order)
            by_rank = deal(order, num_ranks)
        # Ranks first, then each rank's shards to its workers: ranks wait on each other at every
        # step, so their balance matters most; workers of one rank only share its queue. A rank
        # deals only its own shards to its workers (WorkerShards).
        slots = WorkerShards(by_rank, num_workers)
        per_rank = [sum(map(NUM_SAMPLES, rank_shards)) for rank_shards in by_rank]
        return EpochPlan(
            mode=self,
            num_ranks=num_ranks,
            num_workers=num_workers,
            batch_size=batch_size,
            num_samples=num_samples,
            samples_per_rank=per_rank,
            batches_per_rank=[split_batches(n, batch_size) for n in per_rank],
            slots=slots,
            resumed=done is not None,
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
        """The shards dealt to slot rank x workers + worker."""
        if worker >= plan.num_workers or rank >= plan.num_ranks:
            raise ConfigError(
                f"rank {rank}, worker {worker} is not among the {plan.num_ranks} x {plan.num_workers} slots dealt"
            )
        return iter(plan.slot(rank, worker))

    def epoch_batches(self, batches: Iterable[T], plan: EpochPlan, rank: int) -> Iterator[T]:
        return iter(batches)  # the epoch's own end; the loop checks the count against the manifest

    def findings(self, plan: EpochPlan, *, num_shards: int) -> list[Finding]:
        found = _slot_findings(plan, num_shards)
        if plan.min_batches != plan.max_batches:
            late = plan.batches_per_rank.index(plan.max_batches)
            found.append(
                Finding(
                    "note",
                    (
                        f"ranks take {plan.min_batches}..{plan.max_batches} batches: "
                        f"a DDP loop without Join would hang at step {plan.min_batches + 1} "
                        f"(rank {late} waits for ranks that are done); raywds wraps the epoch in Join"
                    ),
                )
            )
        busiest, idlest = max(plan.samples_per_rank), min(plan.samples_per_rank)
        if busiest and (busiest - idlest) / busiest > 0.1 and not plan.resumed:
            found.append(
                Finding(
                    "warn",
                    (
                        f"ranks are uneven: {idlest}..{busiest} samples, so the least loaded rank idles "
                        f"{100 * (busiest - idlest) / busiest:.0f}% of each epoch; "
                        "more, smaller shards (--maxcount) even it out"
                    ),
                )
            )
        folded = sum(1 for n in plan.samples_per_rank if n > 1 and n % plan.batch_size == 1)
        if folded:
            found.append(
                Finding(
                    "note",
                    f"{folded} rank(s) end with one spare sample; "
                    "it joins their previous batch (BatchNorm cannot train on one)",
                )
            )
        found.append(Finding("note", f"every sample once: {sum(plan.samples_per_rank)} samples this epoch"))
        return found

    def rank_columns(self, plan: EpochPlan, rank: int) -> tuple[str, int]:
        samples, batches = plan.samples_per_rank[rank], plan.batches_per_rank[rank]
        num_shards = len(plan.slots.by_rank[rank])
        return str(num_shards), samples - (batches - 1) * plan.batch_size if batches else 0

    def worker_lines(self, plan: EpochPlan, ranks: list[int]) -> list[str]:
        lines = ["shards each worker opens:"]
        for rank in ranks[:2]:
            for worker in range(plan.num_workers):
                names = shardsum(sorted(s.name for s in plan.slot(rank, worker)))
                more = f" ... ({len(plan.slot(rank, worker))} shards)" if len(names) > 6 else ""
                lines.append(f"  rank {rank} worker {worker}: " + (" ".join(names[:6]) + more if names else "(none)"))
        return lines


def _slot_findings(plan: EpochPlan, num_shards: int) -> list[Finding]:
    """Whether every (rank, worker) slot gets shards, and every rank samples."""
    found: list[Finding] = []
    slots = plan.num_ranks * plan.num_workers
    if not plan.resumed and num_shards < slots:
        fewer = " or use fewer --loader-workers" if plan.num_workers > 1 else ""
        found.append(
            Finding(
                "refuse",
                (
                    f"split mode needs at least one shard per (rank, loader worker): {num_shards} shards < "
                    f"{plan.num_ranks} ranks x {plan.num_workers} workers, so {slots - num_shards} workers would "
                    f"read nothing; reconvert with a smaller --maxcount (about {suggested_maxcount(plan)}, "
                    f"for {SHARDS_PER_RANK} shards or more per rank and one or more per worker){fewer}"
                ),
            )
        )
    empty = sum(1 for n in plan.samples_per_rank if n == 0)
    if plan.resumed and empty:
        left = sum(len(shards) for shards in plan.slots.by_rank)
        found.append(
            Finding(
                "warn",
                f"{empty} of {plan.num_ranks} ranks have no samples left in this epoch ({left} shards are); "
                "they wait in Join while the others finish it, and all start the next epoch together",
            )
        )
    if empty and not plan.resumed and num_shards >= slots:
        found.append(
            Finding(
                "warn",
                f"{empty} of {plan.num_ranks} ranks get no shards in this epoch: with --canonical-nodes, give "
                "at least as many canonical nodes as nodes (a multiple of the node count keeps the nodes even)",
            )
        )
    idle = plan.slots.idle()
    if idle and not plan.resumed and num_shards >= slots:
        found.append(
            Finding(
                "warn",
                f"{idle} loader workers get no shard (a few shards are much larger than the rest); "
                "smaller shards (--maxcount) keep every worker busy",
            )
        )
    return found
