"""The training crop's augmentations after the crop and flip, in the loader workers, on the small
uint8 crop (not the full image): torchvision's own transforms (the policies on the crop as a PIL
image, as the reference recipe has it: 0.5 ms a 176 px crop where its tensor ops take 1.1):
(TrivialAugmentWide, RandAugment,
AugMix, AutoAugment, RandomErasing), in the order its reference recipe applies them, each crop's
draws from a seed of its own (seed, epoch, sample id), so a resumed epoch, another worker or a
Ray Data task draws the same augmentations for a sample.

    augment = Augment.of(cfg)                    # None when the config asks for none
    crop = augment(crop, seed=0, epoch=3, sample_id=1234)

torchvision's reference erases after normalising, with 0; here the crop is still uint8, so
the erased box is filled with the mean pixel rounded to uint8 (MEAN_PIXEL), within 0.5/255 of
the mean, which normalising makes 0 (at most 0.009 off). The box is drawn as torchvision draws it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from raywds.loader.settings import augments
from raywds.plan import seeds

MEAN_PIXEL = (124, 116, 104)
"""ImageNet's mean pixel (0.485, 0.456, 0.406 x 255), rounded: what an erased box is filled with."""


@dataclass(frozen=True)
class Augment:
    auto_augment: str | None = None
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0

    @classmethod
    def of(cls, cfg: Any) -> Augment | None:
        """The augmentations a TrainConfig or LoaderConfig asks for, or None."""
        if not augments(cfg):
            return None
        return cls(cfg.auto_augment, cfg.ra_magnitude, cfg.augmix_severity, cfg.random_erase)

    @functools.cached_property
    def transform(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The transforms, built where first used (a loader worker): torchvision's import is 1.5-2.5 s."""
        from torchvision import transforms

        bilinear = transforms.InterpolationMode.BILINEAR  # the reference's default --interpolation
        steps: list[Callable[[Any], Any]] = []
        if self.auto_augment == "ra":
            steps.append(transforms.RandAugment(interpolation=bilinear, magnitude=self.ra_magnitude))
        elif self.auto_augment == "ta_wide":
            steps.append(transforms.TrivialAugmentWide(interpolation=bilinear))
        elif self.auto_augment == "augmix":
            steps.append(transforms.AugMix(interpolation=bilinear, severity=self.augmix_severity))
        elif self.auto_augment is not None:
            policy = transforms.AutoAugmentPolicy(self.auto_augment)
            steps.append(transforms.AutoAugment(policy=policy, interpolation=bilinear))
        if steps:  # on a PIL image, as the reference's: the same pixels, in half the time of its tensor ops
            steps = [transforms.ToPILImage(), *steps, transforms.PILToTensor()]
        if self.random_erase:
            steps.append(transforms.RandomErasing(p=self.random_erase, value=MEAN_PIXEL))
        return transforms.Compose(steps)

    def __call__(self, crop: torch.Tensor, *, seed: int, epoch: int, sample_id: int) -> torch.Tensor:
        """`crop` (uint8 CHW) augmented, drawn from the sample's own seed; torch's global generator
        is left as it was (torchvision's transforms draw from it)."""
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seeds.number(seeds.AUGMENT, seed, epoch, sample_id))
            return self.transform(crop)

    def __getstate__(self) -> dict[str, Any]:
        """The settings alone: each process builds its own transforms."""
        return {k: v for k, v in self.__dict__.items() if k != "transform"}
