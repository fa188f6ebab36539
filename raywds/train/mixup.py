"""--mixup-alpha and --cutmix-alpha: a training batch mixed with itself rolled by one sample, on
the device after normalising, as torchvision's reference recipe does it in its collate function:
torchvision's own v2.MixUp and v2.CutMix, one of the two per batch (v2.RandomChoice) where both
are on, the labels becoming the mixed one-hot targets the loss takes (label smoothing applies on
top). Each batch's draws come from a seed of its own (seed, epoch, its first sample's id), so a
resumed epoch mixes its batches as the first run did.

    mix = Mix.for_run(cfg, num_classes=1000)        # None when both alphas are 0
    images, targets = mix(images, labels, ids, epoch=3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raywds.plan import seeds
from raywds.train.config import TrainConfig


@dataclass(frozen=True)
class Mix:
    transform: Any
    seed: int

    @classmethod
    def for_run(cls, cfg: TrainConfig, num_classes: int) -> Mix | None:
        if not cfg.mixup_alpha and not cfg.cutmix_alpha:
            return None
        from torchvision.transforms import v2

        choices: list[Any] = []
        if cfg.mixup_alpha:
            choices.append(v2.MixUp(alpha=cfg.mixup_alpha, num_classes=num_classes))
        if cfg.cutmix_alpha:
            choices.append(v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=num_classes))
        return cls(choices[0] if len(choices) == 1 else v2.RandomChoice(choices), cfg.seed)

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor, *, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch mixed and its targets (N x classes, each row summing to 1). The draws (which
        of the two, lambda, the box) are made on the CPU from the batch's seed; torch's global
        generators are left as they were."""
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seeds.number(seeds.MIX, self.seed, epoch, int(ids[0])))
            mixed, targets = self.transform(images, labels)
        return mixed, targets
