"""`--model-ema`: an exponential moving average of the weights, as torchvision's reference recipe
keeps one (`references/classification/utils.py: ExponentialMovingAverage`, and its train.py):

    ema = ModelEma.for_run(model, cfg, world)    # None without --model-ema
    ema.after_step(optimizer_steps, epoch)       # every --model-ema-steps optimizer steps
    evaluate(model, batches, world, compute, ema=ema.module)

Every `--model-ema-steps` optimizer steps the average moves towards the weights (and the
buffers, BatchNorm's statistics included) by 1 - decay, where decay is `--model-ema-decay`
adjusted as the reference adjusts it for its global batch, update interval and epochs:
alpha = min(1, (1 - decay) x global batch x steps / epochs), decay = 1 - alpha. During warm-up
the average is the weights themselves (the reference resets its count each update then). The
average is validated beside the model (`val_top1_ema`, ...) and kept in every checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel

from raywds.train.config import TrainConfig
from raywds.world import World


def adjusted_decay(cfg: TrainConfig, world: World) -> float:
    """The reference's decay for this run: its alpha scaled by global batch x steps / epochs."""
    global_batch = cfg.global_batch or world.world_size * cfg.batch_size
    alpha = min(1.0, (1.0 - cfg.model_ema_decay) * global_batch * cfg.model_ema_steps / cfg.epochs)
    return 1.0 - alpha


class ModelEma(AveragedModel):
    """torch's AveragedModel with the reference's update: decay x average + (1 - decay) x weights."""

    def __init__(self, model: nn.Module, decay: float, every: int, warmup_epochs: float):
        def ema(average: torch.Tensor, weights: torch.Tensor, count: Any) -> torch.Tensor:
            return decay * average + (1.0 - decay) * weights

        super().__init__(model, avg_fn=ema, use_buffers=True)
        self.decay, self.every, self.warmup_epochs = decay, every, warmup_epochs

    @classmethod
    def for_run(cls, model: nn.Module, cfg: TrainConfig, world: World) -> ModelEma | None:
        if not cfg.model_ema:
            return None
        return cls(model, adjusted_decay(cfg, world), cfg.model_ema_steps, cfg.warmup_epochs)

    def after_step(self, model: nn.Module, optimizer_steps: int, epoch: int) -> bool:
        """After the run's `optimizer_steps`-th optimizer step, in epoch `epoch` (from 0): update
        every `every` steps; True when it did."""
        if optimizer_steps % self.every:
            return False
        self.update_parameters(model)
        if epoch < self.warmup_epochs:  # the reference: keep copying the weights during warm-up
            self.n_averaged.fill_(0)
        return True

    def same_on_every_rank(self, world: World) -> nn.Module:
        """The average, rank 0's on every rank (the ranks of a split epoch take different numbers
        of steps, and so of updates): what every rank validates and rank 0 checkpoints."""
        if world.distributed:
            for tensor in [*self.parameters(), *self.buffers()]:
                dist.broadcast(tensor, 0)
        return self.module
