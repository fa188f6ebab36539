"""The DataModule's callback: what each rank trains in an epoch, split epochs kept exact under
DDP (raywds.lightning.joined), checked at the epoch's end, and checkpoints inside an epoch.

Checkpoints inside an epoch (`cfg.checkpoint_every_steps`, to `<out>/last.ckpt`) are taken
as `raywds train` takes them: in split mode only while every rank still has batches, since the
position is counted over all ranks (a collective). A Lightning `ModelCheckpoint` that saves every
N steps or minutes is refused in split mode on several ranks for the same reason; one that saves
at epochs' ends is fine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from raywds.errors import ConfigError, DataError
from raywds.lightning.joined import JoinUneven
from raywds.plan.epoch import EpochPlan
from raywds.plan.position import Position
from raywds.runs import files
from raywds.train.ledger import Ledger, sum_and_max, tally
from raywds.train.progress import too_many_bad

if TYPE_CHECKING:
    from raywds.lightning.datamodule import ShardDataModule

log = logging.getLogger(__name__)


@dataclass
class EpochRun:
    """One rank's (part of an) epoch as this run trains it."""

    index: int
    plan: EpochPlan
    position: Position | None
    """Where a resumed epoch starts; None from its beginning."""
    ledger: Ledger
    steps: int = 0
    """The epoch's steps so far, a resumed epoch's earlier ones included (set from `position`)."""
    samples: int = 0
    """Samples this rank trained on in this run's part of the epoch."""
    bad: dict[str, str] = field(default_factory=dict)
    """resample mode: each distinct bad sample this rank skipped -> why."""
    finished: bool = False
    """This rank has trained every batch the plan gave it."""
    closed: bool = False
    """The epoch's end has been counted (then `left` is what it left undone)."""
    left: Position | None = None
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.steps = self.step_before

    @property
    def step_before(self) -> int:
        return self.position.step if self.position else 0

    @property
    def done_before(self) -> int:
        return self.position.samples_done if self.position else 0


class ExactEpochs(pl.Callback):
    def __init__(self, data: ShardDataModule):
        self.data = data
        self.join = JoinUneven()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = self._epoch()
        epoch.started = time.perf_counter()
        if epoch.plan.mode.exact and trainer.world_size > 1:
            for c in trainer.checkpoint_callbacks:
                if isinstance(c, ModelCheckpoint) and (c._every_n_train_steps or c._train_time_interval):
                    raise ConfigError(
                        "in split mode on several ranks a ModelCheckpoint may save only at epochs' ends (a rank "
                        "whose batches ran out cannot join a checkpoint's collectives): drop every_n_train_steps "
                        "and train_time_interval, and set checkpoint_every_steps in the TrainConfig instead"
                    )
            self.join.on_train_epoch_start(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        data, epoch, cfg = self.data, self._epoch(), self.data.cfg
        epoch.steps += 1
        ran = epoch.steps - epoch.step_before
        allowed = cfg.bad_samples_allowed(sum(epoch.plan.samples_per_rank))
        if len(epoch.bad) > allowed:
            raise too_many_bad(epoch.bad, len(epoch.bad), allowed, cfg, "on this rank")
        every = cfg.checkpoint_every_steps
        if every and ran <= epoch.plan.min_batches and ran < epoch.plan.max_batches and epoch.steps % every == 0:
            trainer.save_checkpoint(Path(cfg.out) / files.LIGHTNING_CHECKPOINT)
            if data.audit is not None:
                data.audit.segment(data.step())
            if trainer.is_global_zero:
                log.info(f"step {data.step()}: checkpoint inside epoch {epoch.index + 1}")
        epoch.finished = ran >= epoch.plan.batches_per_rank[trainer.global_rank]
        stopping = trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps
        self.join.after_batch(trainer, last=epoch.finished or stopping)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank, after every rank has left the epoch's Join: count the epoch (collectives)."""
        self.join.leave()
        data, epoch = self.data, self._epoch()
        world = data.world()
        counted = tally(epoch.ledger, world, epoch.position, flags=True)
        (samples, finished), seconds = sum_and_max(
            world, [float(epoch.samples), float(epoch.finished)], time.perf_counter() - epoch.started
        )
        done = finished == world.world_size
        if done and epoch.plan.mode.exact and (counted.duplicates or counted.missing):
            raise DataError(
                f"split epoch {epoch.index + 1} was not exact: {counted.samples} samples trained, the manifest "
                f"has {data.num_samples}; {counted.duplicates} repeated, {counted.missing} missing"
            )
        data.samples_seen += int(samples)
        step = data.step()
        if done:
            data.steps_before += epoch.step_before + epoch.plan.max_batches
        epoch.closed = True
        epoch.left = None if done else self._position(epoch, counted if epoch.plan.mode.exact else None)
        if not done:  # max_steps stopped it: raywds train's row for a stop inside an epoch
            data.metrics = {
                "inside_epoch": True,
                "epoch": epoch.index,
                "step": step,
                "samples_seen": data.samples_seen,
            }
            return
        data.metrics = {
            "epoch": epoch.index + 1,
            "epoch_samples": counted.samples,
            "train_samples": int(samples),
            "samples_seen": data.samples_seen,
            "images_per_s": samples / max(seconds, 1e-9),
        }

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.join.on_exception(trainer, pl_module, exception)

    def position_now(self) -> Position | None:
        """Where the epoch stands, for a checkpoint (a collective in split mode, on every rank)."""
        epoch = self.data.epoch
        if epoch is None:
            return self.data.position
        if epoch.closed:
            return epoch.left
        if epoch.finished:  # the epoch's end (its validation): every rank has trained its share
            return None
        counted = tally(epoch.ledger, self.data.world(), epoch.position, flags=True) if epoch.plan.mode.exact else None
        return self._position(epoch, counted)

    def _position(self, epoch: EpochRun, counted: Any) -> Position:
        data = self.data
        if counted is not None:
            return Position(
                mode=epoch.plan.mode,
                epoch=epoch.index,
                step=epoch.steps,
                samples_done=counted.distinct,
                shards_done=counted.shards_done,
                partial=counted.partial,
                dataset=data.manifest.fingerprint("train"),
            )
        world = data.world()
        ran = epoch.steps - epoch.step_before
        return Position(
            mode=epoch.plan.mode,
            epoch=epoch.index,
            step=epoch.steps,
            samples_done=epoch.done_before + ran * world.world_size * data.cfg.batch_size,
            shards_done=None,
            dataset=data.manifest.fingerprint("train"),
        )

    def _epoch(self) -> EpochRun:
        assert self.data.epoch is not None, "train_dataloader() plans each epoch before it starts"
        return self.data.epoch
