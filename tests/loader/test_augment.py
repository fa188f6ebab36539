"""--auto-augment and --random-erase: torchvision's own transforms on the crop, each sample's draws
from its own seed, so workers, ranks and a resumed epoch draw the same; the samples an epoch
trains on do not change."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support.runs import small_config
from torchvision import transforms
from torchvision.transforms import functional as F

from raywds.data.manifest import read_manifest
from raywds.errors import ConfigError
from raywds.loader.augment import MEAN_PIXEL, Augment
from raywds.loader.crops import crop_rng, train_crop
from raywds.loader.loader import train_loader
from raywds.loader.stages import Batch
from raywds.plan import seeds
from raywds.plan.modes import Split, epoch_plan
from raywds.plan.position import Position, done_in
from raywds.train.compute import MEAN_255, STD_255
from raywds.world import World

BILINEAR = transforms.InterpolationMode.BILINEAR
POLICIES = {  # as the reference's ClassificationPresetTrain builds them (--interpolation bilinear)
    "ta_wide": lambda: transforms.TrivialAugmentWide(interpolation=BILINEAR),
    "ra": lambda: transforms.RandAugment(interpolation=BILINEAR, magnitude=9),
    "augmix": lambda: transforms.AugMix(interpolation=BILINEAR, severity=3),
    "imagenet": lambda: transforms.AutoAugment(transforms.AutoAugmentPolicy.IMAGENET, interpolation=BILINEAR),
}


def photo_crop(sample_id: int = 0, size: int = 96) -> torch.Tensor:
    """A training crop of a photo-like JPEG, as the `cpu` decoder makes it."""
    import io

    rng = np.random.default_rng(sample_id)
    y, x = np.mgrid[0:300, 0:400]
    pixels = np.stack([x * 0.6, y * 0.8, (x + y) * 0.3], axis=-1) + rng.normal(0, 20, (300, 400, 3))
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
    return train_crop(out.getvalue(), size, (0.25, 1.0), rng=crop_rng(0, 0, sample_id))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_each_policy_is_torchvisions_on_the_same_crop_and_seed(policy: str) -> None:
    """The reference recipe runs the policy on the PIL crop, drawing from torch's generator: for the
    sample's seed, the same pixels; each sample draws its own (most crops come out changed, in
    different ways), and torch's global generator is left as it was."""
    augment = Augment(policy)
    outs = []
    for i in range(12):
        crop = photo_crop(i)
        before = torch.get_rng_state()
        got = augment(crop, seed=3, epoch=2, sample_id=i)
        assert torch.equal(torch.get_rng_state(), before), "torch's global generator must be left as it was"
        torch.manual_seed(seeds.number(seeds.AUGMENT, 3, 2, i))
        want = F.pil_to_tensor(POLICIES[policy]()(F.to_pil_image(crop)))
        assert got.shape == crop.shape and got.dtype == torch.uint8
        assert torch.equal(got, want), f"sample {i}: {(got.int() - want.int()).abs().max()} levels from torchvision's"
        outs.append((crop, got))
    changed = sum(not torch.equal(c, g) for c, g in outs)
    assert changed >= 8, f"only {changed} of 12 crops changed: the policy must act"
    again = augment(photo_crop(5), seed=3, epoch=2, sample_id=5)
    assert torch.equal(again, outs[5][1]), "the same sample, seed and epoch draw the same"
    redrawn = sum(not torch.equal(augment(c, seed=3, epoch=3, sample_id=i), g) for i, (c, g) in enumerate(outs))
    assert redrawn >= 9, f"only {redrawn} of 12 crops drew differently in another epoch: the epoch must seed the draw"


def test_random_erase_is_torchvisions_after_normalising() -> None:
    """The reference erases the normalised crop with 0; raywds erases the uint8 crop with the mean
    pixel: the same boxes, the same pixels elsewhere, and within 0.009 inside once normalised."""
    mean, std = torch.tensor(MEAN_255).view(3, 1, 1), torch.tensor(STD_255).view(3, 1, 1)
    augment, erased = Augment(None, random_erase=0.5), 0
    for i in range(40):
        crop = photo_crop(i, size=64)
        got = (augment(crop, seed=0, epoch=0, sample_id=i).float() - mean) / std
        torch.manual_seed(seeds.number(seeds.AUGMENT, 0, 0, i))
        want = transforms.RandomErasing(p=0.5, value=0)((crop.float() - mean) / std)
        box = (want == 0).all(dim=0)
        assert torch.equal(got[:, ~box], want[:, ~box]), f"sample {i}: pixels outside the box must be untouched"
        assert (got - want).abs().max().item() <= 0.009, f"sample {i}: the erased box must be 0 once normalised"
        erased += bool(box.any())
    assert 10 <= erased <= 30, f"{erased} of 40 erased at p=0.5"
    assert MEAN_PIXEL == tuple(round(m) for m in MEAN_255)


def augmented_config(shards: Path, **overrides: object) -> object:
    values = dict(batch_size=8, image_size=24, mode="split", worker_shuffle_buffer=0)
    return small_config(shards, **{**values, **overrides})


def images_by_id(
    shards: Path, cfg: object, world_size: int, position: Position | None = None
) -> dict[int, torch.Tensor]:
    manifest = read_manifest(str(shards))
    plan = epoch_plan(manifest, cfg, world_size, epoch=0, done=done_in(position, 0))  # type: ignore[arg-type]
    out: dict[int, torch.Tensor] = {}
    for rank in range(world_size):
        world = World(rank=rank, world_size=world_size)
        batches: list[Batch] = list(train_loader(manifest, cfg.loader(), world, plan, epoch=0, position=position))  # type: ignore[arg-type]
        out.update({int(i): b.images[j].clone() for b in batches for j, i in enumerate(b.ids)})
    return out


@pytest.mark.slow
def test_a_samples_augmentations_depend_on_its_seed_alone_and_a_resumed_epoch_draws_them_again(uneven: Path) -> None:
    """1 rank x 0 workers, 2 ranks x 1 shuffling worker, and the rest of an epoch resumed on 3
    ranks: each sample's augmented crop is the same; the epoch trains on the same samples as
    without augmentations, and most of their crops differ from the plain ones."""
    cfg = augmented_config(uneven, auto_augment="ta_wide", random_erase=0.5, loader_workers=0)
    one = images_by_id(uneven, cfg, 1)
    many = images_by_id(uneven, augmented_config(uneven, auto_augment="ta_wide", random_erase=0.5,
                                                 loader_workers=1, worker_shuffle_buffer=30), 2)  # fmt: skip
    assert one.keys() == many.keys() and len(one) == 120
    assert all(torch.equal(one[i], many[i]) for i in one), "the workers and ranks must not change a sample's draws"
    plain = images_by_id(uneven, augmented_config(uneven, loader_workers=0), 1)
    assert plain.keys() == one.keys(), "augmentations change no sample the epoch trains on"
    assert sum(not torch.equal(one[i], plain[i]) for i in one) > 80
    manifest = read_manifest(str(uneven))
    done = np.zeros(120, dtype=bool)
    done[random.Random(2).sample(range(120), 50)] = True
    position = Position.of_flags(done, manifest.shards("train"), mode=Split(), epoch=0, step=3, samples_done=50,
                                 dataset=manifest.fingerprint("train"))  # fmt: skip
    resumed = images_by_id(uneven, augmented_config(uneven, auto_augment="ta_wide", random_erase=0.5,
                                                    loader_workers=0), 3, position)  # fmt: skip
    assert sorted(resumed) == [i for i in range(120) if not done[i]]
    assert all(torch.equal(resumed[i], one[i]) for i in resumed), "the resumed epoch must draw the same augmentations"


def test_augmentations_are_refused_where_the_device_decodes() -> None:
    with pytest.raises(ConfigError, match="use --decode cpu or pil with them, not device"):
        small_config("shards/", decode="device", auto_augment="ta_wide").loader()
    with pytest.raises(ConfigError, match="random_erase"):
        small_config("shards/", random_erase=1.5)
    with pytest.raises(ConfigError, match="auto_augment"):
        small_config("shards/", auto_augment="cifar")
