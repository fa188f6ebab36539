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

from typing import Protocol

from raywds.data.manifest import Manifest
from raywds.errors import ConfigError
from raywds.plan.epoch import Done, EpochPlan, Mode, Nodes
from raywds.plan.resample import Resample
from raywds.plan.split import Split

__all__ = ["MODES", "Mode", "Resample", "Split", "Schedule", "epoch_plan", "loader_slots", "parse"]


class Schedule(Protocol):
    """The plan section of a run's config: what an epoch's plan reads of it and nothing else (the
    training config, raywds.config.TrainConfig, is one; so is `raywds plan`'s)."""

    @property
    def mode(self) -> str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def batches_per_epoch(self) -> int | None: ...
    @property
    def canonical_nodes(self) -> int: ...
    @property
    def loader_worker_count(self) -> int: ...


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
