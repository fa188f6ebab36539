"""Optimizer and learning-rate schedule. The rate is a function of progress (epochs done,
fractional), not a stepped scheduler: in split mode ranks take different step counts, yet
must agree on the rate at every epoch boundary, and a resumed run needs no scheduler state."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from raywds.train.config import TrainConfig
from raywds.world import World

NORMS = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)
"""The layers torchvision's reference counts as norms (`utils.set_weight_decay`'s norm_classes)."""


def parameter_groups(
    model: nn.Module, cfg: TrainConfig, scales: Mapping[str, float] | None = None
) -> list[dict[str, object]]:
    """The weights with --weight-decay, the norms' parameters with --norm-weight-decay, the other
    biases with --bias-weight-decay, split as torchvision's reference splits them; with `scales`
    (--layer-decay: raywds.models.finetune.layer_scales) each also by its learning-rate scale, kept
    in the group as `lr_scale`, as timm keeps it. Empty groups left out."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups: dict[tuple[int, float], list[nn.Parameter]] = {}
    decays = (cfg.weight_decay, cfg.norm_weight_decay, cfg.bias_weight_decay)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            kind = 1 if isinstance(module, NORMS) else 2 if name == "bias" or p.ndim <= 1 else 0
            scale = scales.get(names[id(p)], 1.0) if scales is not None else 1.0
            groups.setdefault((kind, scale), []).append(p)
    made: list[dict[str, object]] = []
    for (kind, scale), params in sorted(groups.items(), key=lambda item: (item[0][0], -item[0][1])):
        group: dict[str, object] = {"params": params, "weight_decay": decays[kind]}
        if scales is not None:
            group["lr_scale"] = scale
        made.append(group)
    return made


def make_optimizer(
    model: nn.Module, cfg: TrainConfig, world: World, scales: Mapping[str, float] | None = None
) -> torch.optim.Optimizer:
    """SGD (nesterov momentum) or AdamW over `parameter_groups` (no decay on norms and biases by default)."""
    lr = cfg.peak_lr(world.world_size)
    groups = parameter_groups(model, cfg, scales)
    for group in groups:
        group["lr"] = lr * float(group.get("lr_scale", 1.0))  # type: ignore[arg-type]
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
    """`lr` in every group, times the group's --layer-decay scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
