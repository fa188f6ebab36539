"""The two ways an epoch reads the data, as objects: `Resample` (raywds.plan.resample) and
`Split` (raywds.plan.split). A mode owns everything that differs between them (the base,
`Mode`, is in raywds.plan.epoch): how the epoch is planned, which shards a loader worker
reads, where its batches end, what the plan's verdict says. Config text names a mode
(`--mode resample|split`); `parse` turns it into one of these objects, and nothing else
compares mode names.

    plan = epoch_plan(manifest, cfg, world.world_size, epoch=0)
    plan.mode.exact        # True in split mode: every sample once, ranks may be uneven
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from raywds.data.manifest import Manifest
from raywds.errors import ConfigError
from raywds.fields import MAX_SEED, MAX_STEPS, check_fields, flag
from raywds.plan.epoch import Done, EpochPlan, Mode, Nodes
from raywds.plan.resample import Resample
from raywds.plan.split import Split

__all__ = ["MODES", "Mode", "ModeName", "Resample", "Split", "Schedule", "epoch_plan", "loader_slots", "parse"]


ModeName = Literal["resample", "split"]


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The plan section of a run's config: what an epoch's plan reads and nothing else. The plan
    part declares and checks it; the training config (raywds.train.config.TrainConfig) is composed of it,
    and `raywds plan` takes it alone."""

    mode: ModeName = "resample"
    """`resample`: equal batch counts on every rank. `split`: every sample exactly once per epoch."""
    batch_size: int = field(default=64, metadata=flag(minimum=1, maximum=65_536))
    """Samples per batch on each rank; the global batch is this times the number of ranks."""
    seed: int = field(default=0, metadata=flag(minimum=0, maximum=MAX_SEED))
    """Seeds shard choice, shuffles and weight init."""
    batches_per_epoch: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_STEPS))
    """resample mode: batches per epoch on every rank; None means ceil(N / (ranks x batch))."""
    canonical_nodes: int = field(default=0, metadata=flag(minimum=0, maximum=100_000))
    """split mode: deal the shards once to this many groups for the whole run, each read by one
    node every epoch (shuffled there), so that with --cache-dir a node fetches its shards once;
    0 deals every shard anew each epoch. A multiple of the node count (raywds.plan.split.node_deal)."""
    loader_workers: int | Literal["auto"] = field(default=2, metadata=flag(minimum=0, maximum=512))
    """DataLoader worker processes on each rank, or `auto`: chosen at each epoch's start from the
    last epoch's decode rate and step time, within the rank's cores (raywds.train.autoworkers)."""
    worker_shuffle_buffer: int = field(default=1000, metadata=flag(minimum=0, maximum=10**6))
    """Samples (still encoded) held in each DataLoader worker's shuffle buffer."""
    cross_worker_shuffle_buffer: int = field(default=0, metadata=flag(minimum=0, maximum=10**6))
    """Decoded samples held in a shuffle buffer in the main process, mixing the workers' batches; 0 is off."""

    def __post_init__(self) -> None:
        check_fields(self, Schedule)  # each field's type, choices and range, as declared above
        if self.batches_per_epoch is not None and parse(self.mode).exact:
            raise ConfigError("batches_per_epoch applies to resample mode; split mode's epoch is the whole split once")

    @property
    def loader_worker_count(self) -> int:
        """The loader workers of each rank; `auto` has a count only once an epoch's start chose it."""
        if self.loader_workers == "auto":
            raise ConfigError("loader_workers='auto' is chosen at each epoch's start: no count yet")
        return self.loader_workers


MODES: dict[str, Mode] = {m.name: m for m in (Resample(), Split())}


def parse(name: str) -> Mode:
    """The mode that config text names."""
    if name not in MODES:
        raise ConfigError(f"mode={name!r} is not one of {', '.join(MODES)}")
    return MODES[name]


def loader_slots(workers: int) -> int:
    """Slots per rank: its DataLoader `workers`, or 1 when the main process reads."""
    return max(1, workers)


def nodes_of(canonical_nodes: int, ranks_per_node: int) -> Nodes | None:
    """split mode's shards kept on their nodes (--canonical-nodes), or None for the usual deal."""
    return Nodes(canonical_nodes, ranks_per_node) if canonical_nodes else None


def epoch_plan(
    manifest: Manifest,
    cfg: Schedule,
    num_ranks: int,
    *,
    epoch: int,
    done: Done | None = None,
    ranks_per_node: int = 1,
) -> EpochPlan:
    """A run's plan for `epoch`, or for what is left of it after `done` (raywds.plan.position.done_in),
    for ranks `ranks_per_node` to a node (with --canonical-nodes)."""
    return parse(cfg.mode).plan(
        manifest.shards("train"),
        num_ranks=num_ranks,
        num_workers=loader_slots(cfg.loader_worker_count),
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        epoch=epoch,
        batches_per_epoch=cfg.batches_per_epoch,
        done=done,
        nodes=nodes_of(cfg.canonical_nodes, ranks_per_node),
    )
