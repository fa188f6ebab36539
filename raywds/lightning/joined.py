"""Split epochs under Lightning's DDP: ranks with fewer batches join early, as `raywds train` does.

Lightning's fit loop has no `Join` (Lightning issue #3325). This callback enters one around each
training epoch, with two joinables: our own (first, so it makes Join's per-step "not joined yet"
all-reduce) and Lightning's `DistributedDataParallel`. A rank that has trained its last batch of
the epoch leaves the context in `on_train_batch_end`, before Lightning validates, and from then
on matches the collectives the other ranks still make each step, until every rank is done:

- Join's count, made by the active ranks after each batch (`on_train_batch_end`, and once as the
  epoch starts), so that it comes before the next step's collectives;
- Lightning's own broadcast at the start of every step (whether a rank received SIGTERM), from
  rank 0; a joined rank sends or receives a 0 (no SIGTERM);
- DDP's forward and backward (buffers, the gradient all-reduce, as zeros): DDP's own join hook.

So a user's `training_step` must make no collective of its own in split mode (no
`self.log(..., sync_dist=True)` per step, no `all_gather`); logging torchmetrics objects, which
sync once at the epoch's end, is fine. Checkpoints inside an epoch are taken only while every
rank still trains (raywds.lightning.epochs), since a joined rank cannot join their collectives.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig
from torch.nn.parallel import DistributedDataParallel

from raywds.errors import ConfigError


class _StepBroadcast(JoinHook):
    def __init__(self, step: LightningStep):
        self.step = step

    def main_hook(self) -> None:
        if self.step.broadcasts:
            dist.broadcast(torch.zeros(1, dtype=torch.int64, device=self.step.device), src=0)


class LightningStep(Joinable):
    """The collectives of one step of Lightning's fit loop outside the model, for Join."""

    def __init__(self, device: torch.device, broadcasts: bool):
        super().__init__()
        self.device, self.broadcasts = device, broadcasts

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _StepBroadcast(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


def _sigterm_broadcast(trainer: pl.Trainer) -> bool:
    """Whether this Lightning broadcasts at the start of each training step (2.5 and later do)."""
    return hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor")


class JoinUneven(pl.Callback):
    """Every training epoch in a Join context, left by each rank after its own last batch."""

    def __init__(self) -> None:
        self.join: Join | None = None
        self.step: LightningStep | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size < 2:
            return
        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            raise ConfigError(
                f"split mode on {trainer.world_size} ranks needs Lightning's DDP strategy (ranks with fewer "
                f"batches join the rest through DDP); this run uses {type(trainer.strategy).__name__}: "
                "use strategy='ddp', or --mode resample"
            )
        self.step = LightningStep(trainer.strategy.root_device, _sigterm_broadcast(trainer))
        self.join = Join([self.step, model])
        Join.notify_join_context(self.step)  # the first step's count

    def after_batch(self, trainer: pl.Trainer, last: bool) -> None:
        """After a batch's step: leave (this rank's last batch) or count this rank in for the next step."""
        if self.join is None or self.step is None:
            return
        if last:
            self.leave()
        else:
            Join.notify_join_context(self.step)

    def leave(self) -> None:
        join, self.join = self.join, None
        if join is not None:
            join.__exit__(None, None, None)  # matches the others' steps until every rank has left
            for joinable in join._joinables:
                # Join leaves its config on DDP, whose every forward would then make one more
                # all-reduce, also in validation, where ranks take different numbers of batches
                joinable._join_config = _JoinConfig.construct_disabled_join_config()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.leave()  # an epoch stopped before this rank's last batch (a callback's should_stop)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.join = None  # nothing to match: the run is ending
