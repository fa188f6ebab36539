"""The plan of one epoch for the whole job: which shards each (rank, loader worker) slot
reads, and how many samples and batches each rank takes. Every rank computes the same plan
from shared, seeded inputs; the loaders read it, so what `raywds plan` prints is what
training does. How a plan is made depends on the mode (raywds.plan.modes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, TypeVar, overload

from raywds.data.manifest import ShardInfo, deal

T = TypeVar("T")
Level = Literal["refuse", "warn", "note"]


@dataclass(frozen=True)
class Finding:
    """One line of a plan's verdict: `refuse` stops training before it starts."""

    level: Level
    text: str


def split_batches(num_samples: int, batch_size: int) -> int:
    """Batches a rank takes from `num_samples` in an exact epoch: full ones, then the partial
    rest, except that a rest of one sample joins the batch before it (BatchNorm cannot train on one)."""
    batches = math.ceil(num_samples / batch_size)
    if batches > 1 and num_samples % batch_size == 1:
        batches -= 1
    return batches


@dataclass(frozen=True)
class EpochPlan:
    """One epoch for the whole job, the same on every rank (all inputs are shared and seeded)."""

    mode: Mode
    num_ranks: int
    num_workers: int
    """WorkerShards per rank: DataLoader workers, or 1 when the main process reads."""
    batch_size: int
    num_samples: int
    """Samples in the split (the manifest's count)."""
    samples_per_rank: list[int]
    """Samples each rank trains on this epoch (what is left of it, when resuming)."""
    batches_per_rank: list[int]
    slots: WorkerShards
    """The shards of slot rank x num_workers + worker, when the mode deals shards (split); none in resample."""
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


class WorkerShards(Sequence[list[ShardInfo]]):
    """Each (rank, worker) slot's shards: a rank's shards are dealt to its workers only when one
    of them is asked for, so each rank builds only the slots it reads (a 400,000-shard plan on
    4,096 x 8 slots deals 0.4 s less)."""

    def __init__(self, by_rank: list[list[ShardInfo]], num_workers: int) -> None:
        self.by_rank = by_rank
        self.num_workers = num_workers
        self._dealt: dict[int, list[list[ShardInfo]]] = {}

    def of_rank(self, rank: int) -> list[list[ShardInfo]]:
        """The rank's shards dealt by sample count to its workers."""
        if rank not in self._dealt:
            self._dealt[rank] = deal(self.by_rank[rank], self.num_workers)
        return self._dealt[rank]

    def idle(self) -> int:
        """Workers with no shard, without dealing: a rank's first shards go one to each worker."""
        return sum(max(self.num_workers - len(shards), 0) for shards in self.by_rank)

    def __len__(self) -> int:
        return len(self.by_rank) * self.num_workers

    @overload
    def __getitem__(self, index: int) -> list[ShardInfo]: ...
    @overload
    def __getitem__(self, index: slice) -> list[list[ShardInfo]]: ...
    def __getitem__(self, index: int | slice) -> list[ShardInfo] | list[list[ShardInfo]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        rank, worker = divmod(index % len(self), self.num_workers)
        return self.of_rank(rank)[worker]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"WorkerShards({len(self.by_rank)} ranks x {self.num_workers} workers)"


@dataclass(frozen=True)
class Done:
    """What an epoch delivered before a resume, as much of it as a plan needs
    (raywds.plan.position.Position.done makes it)."""

    samples: int
    """Samples the whole job trained on in this epoch."""
    per_shard: tuple[int, ...] | None = None
    """split mode: the samples of each training shard (manifest order) delivered."""


def remaining(shards: Sequence[ShardInfo], consumed_per_shard: tuple[int, ...]) -> list[ShardInfo]:
    """The shards an interrupted epoch has not finished, each with `num_samples` reduced to what
    it has not yet delivered."""
    return [
        s if not done else ShardInfo(s.name, s.num_samples - done, s.num_bytes, s.sha256)
        for s, done in zip(shards, consumed_per_shard)
        if done < s.num_samples
    ]


@dataclass(frozen=True)
class Nodes:
    """How the ranks sit on nodes, for a deal that keeps shards on their nodes (--canonical-nodes)."""

    canonical: int
    """Groups the run's shards are dealt to once (Mosaic Streaming's canonical nodes); each node
    reads the groups number node, node + nodes, ... for the whole run."""
    ranks_per_node: int
    """Ranks on each node; ranks node x ranks_per_node ... are that node's (torchrun and Ray Train
    number them so)."""


@dataclass(frozen=True)
class Mode:
    """What differs between modes; `Resample` and `Split` fill it in."""

    name: ClassVar[str]
    exact: ClassVar[bool]
    """Every sample once per epoch: ranks may take different batch counts, a rank's last batch
    may be partial, and a sample or shard that cannot be read is an error, never skipped."""

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
        """The epoch's plan, or of what is left of it after `done` (inside this epoch); `nodes`:
        split mode's shards stay on their nodes for the run (raywds.plan.split.node_deal)."""
        raise NotImplementedError

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
