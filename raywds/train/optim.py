"""Optimizer and learning-rate schedule. The rate is a function of progress (epochs done,
fractional), not a stepped scheduler: in split mode ranks take different step counts, yet
must agree on the rate at every epoch boundary, and a resumed run needs no scheduler state."""

from __future__ import annotations

import math

import torch
from torch import nn

from raywds.config import TrainConfig
from raywds.world import World


def make_optimizer(model: nn.Module, cfg: TrainConfig, world: World) -> torch.optim.Optimizer:
    """SGD (nesterov momentum) or AdamW; weight decay only on weights, never on norms and biases."""
    lr = cfg.peak_lr(world.world_size)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)


def lr_at(cfg: TrainConfig, world: World, progress_epochs: float) -> float:
    """Linear warm-up, then cosine decay to zero, as a function of epochs done (fractional).

    A function of progress rather than a stepped scheduler: in split mode ranks take different
    step counts, yet must agree on the rate at every epoch boundary."""
    peak = cfg.peak_lr(world.world_size)
    if progress_epochs < cfg.warmup_epochs:
        return peak * progress_epochs / cfg.warmup_epochs
    span = max(cfg.epochs - cfg.warmup_epochs, 1e-9)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress_epochs - cfg.warmup_epochs) / span)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
