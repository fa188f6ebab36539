"""What survives a resume: the run's progress counters, and the checkpoint's contents
(model, optimizer, progress, data position, the shards and classes it was trained on).
The learning rate is a function of progress, so it needs no state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from raywds.config import TrainConfig
from raywds.data.manifest import Manifest
from raywds.errors import ConfigError
from raywds.plan.epoch import EpochPlan, Mode
from raywds.plan.position import Position, check_same_shards, shard_entries
from raywds.train.ledger import Ledger


@dataclass
class Progress:
    """Counters that survive a resume."""

    epoch: int = 0
    steps: int = 0
    """Steps so far, counting each finished epoch as its longest rank's batches."""
    samples_seen: int = 0
    position: Position | None = None
    """Inside an unfinished epoch: what it has delivered."""
    bad_samples: int = 0
    """Samples skipped as undecodable in the finished epochs (resample mode), once per draw."""
    bad_samples_distinct: int = 0
    """The distinct samples among them, counted by epoch: a sample bad in two epochs counts twice."""


@dataclass
class Epoch:
    """What one run of (part of) an epoch needs to know: its plan, where it started and what it has trained on."""

    index: int
    plan: EpochPlan
    position: Position | None
    """Where a resumed epoch starts; None from its beginning."""
    start: Progress
    """The run's progress when this part of the epoch began."""
    ledger: Ledger
    global_batch: int
    size: int
    """Samples in a whole epoch, for the schedule."""
    bad_allowed: int

    @property
    def done_before(self) -> int:
        return self.position.samples_done if self.position else 0

    @property
    def step_before(self) -> int:
        return self.position.step if self.position else 0


def checkpoint_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, progress: Progress, manifest: Manifest, cfg: TrainConfig
) -> dict[str, Any]:
    position = progress.position
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": progress.epoch,
        "steps": progress.steps,
        "samples_seen": progress.samples_seen,
        "bad_samples": progress.bad_samples,
        "bad_samples_distinct": progress.bad_samples_distinct,
        "position": position.to_state() if position else None,
        "shards": shard_entries(manifest),
        "config": cfg.to_dict(),
        "classes": manifest.classes,
    }


def check_unfinished(state: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse to resume a run that has already trained all of `cfg.epochs`: there is nothing
    left to do, and nothing to report."""
    done = state["epoch"]
    if done >= cfg.epochs and not state.get("position"):
        raise ConfigError(
            f"the checkpoint at {cfg.resume} has already trained {done} epochs, and --epochs is "
            f"{cfg.epochs}: nothing is left to train; to train more, resume with a larger --epochs "
            f"(e.g. --epochs {done + 1})"
        )


def restore(
    state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, manifest: Manifest, mode: Mode
) -> Progress:
    """Load a checkpoint's weights and optimizer into `model` and `optimizer`, after checking
    it was taken on these classes and shards (and, inside an epoch, in `mode`)."""
    if state["classes"] != manifest.classes:
        raise ConfigError(
            f"the checkpoint's {len(state['classes'])} classes differ from the data's "
            f"{len(manifest.classes)}; resume with the same --data"
        )
    if "shards" in state:
        check_same_shards(state["shards"], manifest)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    position = Position.from_state(state["position"], manifest.shards("train")) if state.get("position") else None
    if position is not None:
        position.check_compatible(manifest, mode)
        if position.samples_done == 0:
            position = None
    return Progress(
        epoch=state["epoch"],
        steps=state["steps"],
        samples_seen=state["samples_seen"],
        position=position,
        bad_samples=state.get("bad_samples", 0),
        # older checkpoints counted draws only: each was taken for a sample of its own
        bad_samples_distinct=state.get("bad_samples_distinct", state.get("bad_samples", 0)),
    )
