"""The DataModule's callback: drives the epoch keeper (raywds.train.epoch) through Lightning's
hooks, keeps split epochs exact under DDP (raywds.lightning.joined), checks them at each epoch's
end, and takes checkpoints inside an epoch.

Checkpoints inside an epoch (`cfg.checkpoint_every_steps`, to `<out>/last.ckpt`) are taken when
the keeper says, as `raywds train` takes them: in split mode only while every rank still has
batches, since the position is counted over all ranks (a collective). A Lightning
`ModelCheckpoint` that saves every N steps or minutes is refused in split mode on several ranks
for the same reason; one that saves at epochs' ends is fine.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from raywds.errors import ConfigError
from raywds.lightning.joined import JoinUneven
from raywds.runs import files
from raywds.train.epoch import EpochKeeper
from raywds.train.ledger import sum_and_max, tally

log = logging.getLogger(__name__)


class ExactEpochs(pl.Callback):
    def __init__(self, keeper: EpochKeeper):
        self.keeper = keeper
        self.join = JoinUneven()
        self.metrics: dict[str, Any] = {}
        """The last epoch's counts (every rank), as the kind of row `raywds train` writes for it:
        epoch, epoch_samples, train_samples, samples_seen, images_per_s."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = self.keeper.current()
        epoch.started = time.perf_counter()
        if self.keeper.uneven and trainer.world_size > 1:
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
        keeper = self.keeper
        epoch = keeper.current()
        if keeper.checkpoint_due(epoch.ran):
            trainer.save_checkpoint(Path(keeper.cfg.out) / files.LIGHTNING_CHECKPOINT)  # its state_dict: keeper.now()
            if keeper.audit is not None:
                keeper.audit.segment(epoch.steps)
            if trainer.is_global_zero:
                log.info(f"step {epoch.steps}: checkpoint inside epoch {epoch.index + 1}")
        stopping = trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps
        self.join.after_batch(trainer, last=epoch.finished or stopping)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank, after every rank has left the epoch's Join: count the epoch (collectives)."""
        self.join.leave()
        keeper = self.keeper
        epoch, world = keeper.current(), keeper.world
        counted = tally(epoch.ledger, world, epoch.position, flags=True)
        mine = [float(epoch.samples), float(epoch.finished), float(epoch.bad_draws), float(len(epoch.bad))]
        (samples, finished, draws, bad), seconds = sum_and_max(world, mine, time.perf_counter() - epoch.started)
        if finished < world.world_size:  # max_steps stopped it: raywds train's row for a stop inside an epoch
            progress = keeper.stopped(counted)
            self.metrics = {
                "kind": "checkpoint",
                "inside_epoch": True,
                "epoch": epoch.index,
                "step": progress.steps,
                "samples_seen": progress.samples_seen,
            }
            return
        keeper.check_exact(counted)
        progress = keeper.finish(int(samples), int(draws), int(bad))  # distinct: each rank's, summed
        self.metrics = {
            "kind": "epoch",
            "epoch": epoch.index + 1,
            "epoch_samples": counted.samples,
            "train_samples": int(samples),
            "samples_seen": progress.samples_seen,
            "images_per_s": samples / max(seconds, 1e-9),
        }

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.join.on_exception(trainer, pl_module, exception)
