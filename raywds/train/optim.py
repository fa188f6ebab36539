"""Optimizer and learning-rate schedule. The rate is a function of progress (epochs done,
fractional), not a stepped scheduler: in split mode ranks take different step counts, yet
must agree on the rate at every epoch boundary, and a resumed run needs no scheduler state."""

from __future__ import annotations

import math

import torch
from torch import nn

from raywds.config import TrainConfig
from raywds.world import World

NORMS = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)
"""The layers torchvision's reference counts as norms (`utils.set_weight_decay`'s norm_classes)."""


def parameter_groups(model: nn.Module, cfg: TrainConfig) -> list[dict[str, object]]:
    """The weights with --weight-decay, the norms' parameters with --norm-weight-decay, the other
    biases with --bias-weight-decay, split as torchvision's reference splits them; empty groups left out."""
    weights: list[nn.Parameter] = []
    norms: list[nn.Parameter] = []
    biases: list[nn.Parameter] = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if isinstance(module, NORMS):
                norms.append(p)
            elif name == "bias" or p.ndim <= 1:
                biases.append(p)
            else:
                weights.append(p)
    groups = [(weights, cfg.weight_decay), (norms, cfg.norm_weight_decay), (biases, cfg.bias_weight_decay)]
    return [{"params": params, "weight_decay": decay} for params, decay in groups if params]


def make_optimizer(model: nn.Module, cfg: TrainConfig, world: World) -> torch.optim.Optimizer:
    """SGD (nesterov momentum) or AdamW over `parameter_groups` (no decay on norms and biases by default)."""
    lr = cfg.peak_lr(world.world_size)
    groups = parameter_groups(model, cfg)
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
