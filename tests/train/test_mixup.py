"""--mixup-alpha and --cutmix-alpha: torchvision's v2 MixUp and CutMix on the device, one of the two
per batch, drawn from the batch's own seed; the targets sum to one and follow the alpha."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from support.runs import small_config
from torchvision.transforms import v2

from raywds.plan import seeds
from raywds.runs.folder import RunDir
from raywds.train.mixup import Mix
from raywds.train.trainer import train
from raywds.world import World

CLASSES = 10


def batch(first_id: int, n: int = 8, side: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images that differ everywhere, labels no two neighbours share, and the batch's ids."""
    gen = torch.Generator().manual_seed(first_id)
    images = torch.randn(n, 3, side, side, generator=gen) + torch.arange(n).view(n, 1, 1, 1) * 10
    return images, torch.arange(n) % CLASSES, torch.arange(first_id, first_id + n)


def test_the_mix_is_torchvisions_for_the_batchs_seed() -> None:
    """For the batch's seed, the same images and targets as the reference's collate function
    (RandomChoice of MixUp and CutMix), both kinds drawn over 40 batches; the same batch mixes
    the same again, another epoch differently, and torch's global generator is untouched."""
    mix = Mix.for_run(small_config("shards/", mixup_alpha=0.2, cutmix_alpha=1.0, seed=4), CLASSES)
    assert mix is not None
    kinds = set()
    for first in range(0, 400, 10):
        images, labels, ids = batch(first)
        before = torch.get_rng_state()
        got, targets = mix(images.clone(), labels, ids, epoch=2)
        assert torch.equal(torch.get_rng_state(), before)
        torch.manual_seed(seeds.number(seeds.MIX, 4, 2, first))
        reference = v2.RandomChoice(
            [v2.MixUp(alpha=0.2, num_classes=CLASSES), v2.CutMix(alpha=1.0, num_classes=CLASSES)]
        )
        want, want_targets = reference(images.clone(), labels)
        assert torch.equal(got, want) and torch.equal(targets, want_targets), f"batch from id {first}"
        kinds.add("cutmix" if (got == images).any() else "mixup")  # a cutmix batch keeps pixels outside its box
        again, _ = mix(images.clone(), labels, ids, epoch=2)
        assert torch.equal(again, got), "the same batch must mix the same (a resumed epoch)"
    assert kinds == {"mixup", "cutmix"}, "one of the two per batch"
    images, labels, ids = batch(0)
    assert not torch.equal(mix(images.clone(), labels, ids, epoch=3)[0], mix(images.clone(), labels, ids, epoch=2)[0])


def lambdas(alpha: float, kind: str, batches: int = 300) -> list[float]:
    """Each batch's lambda, read from its targets (the weight of a sample's own class), checked
    against its pixels: mixup's image is lambda x + (1 - lambda) x rolled; cutmix's has the
    rolled copy's pixels on exactly 1 - lambda of its area."""
    key = "mixup_alpha" if kind == "mixup" else "cutmix_alpha"
    mix = Mix.for_run(small_config("shards/", **{key: alpha}), CLASSES)
    assert mix is not None
    out = []
    for first in range(batches):
        images, labels, ids = batch(first * 8)
        got, targets = mix(images.clone(), labels, ids, epoch=0)
        assert targets.shape == (8, CLASSES)
        assert torch.allclose(targets.sum(dim=1), torch.ones(8)), "each target sums to one"
        lam = targets[0, labels[0]].item()
        if kind == "mixup":
            assert torch.allclose(got, lam * images + (1 - lam) * images.roll(1, 0), atol=1e-4)
        else:
            pasted = (got != images).any(dim=1).float().mean(dim=(1, 2))
            assert torch.allclose(pasted, torch.full((8,), 1 - lam), atol=1e-6)
        out.append(lam)
    return out


def cutmix_lambdas(alpha: float, n: int = 4000, side: int = 16) -> list[float]:
    """The CutMix paper's lambda after its box is clipped: a box of side x sqrt(1 - lambda)
    around a uniform centre, lambda ~ Beta(alpha, alpha), corrected to the area pasted."""
    rng, out = np.random.default_rng(0), []
    for _ in range(n):
        lam = rng.beta(alpha, alpha)
        cx, cy, half = rng.integers(side), rng.integers(side), int(0.5 * np.sqrt(1 - lam) * side)
        w = min(cx + half, side) - max(cx - half, 0)
        h = min(cy + half, side) - max(cy - half, 0)
        out.append(1 - w * h / side**2)
    return out


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_targets_sum_to_one_and_lambda_follows_the_alpha(kind: str) -> None:
    """Lambda is Beta(alpha, alpha): a KS test accepts it for the alpha asked and rejects it for
    another (mixup's lambda exactly; cutmix's box is clipped at the image's edges, which makes
    lambda larger: it is compared with the CutMix paper's box drawn here)."""
    for alpha, other in ((0.2, 1.0), (1.0, 0.2)):
        lam = lambdas(alpha, kind)
        if kind == "mixup":
            assert stats.kstest(lam, "beta", args=(alpha, alpha)).pvalue > 0.001, alpha
            assert stats.kstest(lam, "beta", args=(other, other)).pvalue < 0.001, "the test must tell alphas apart"
        else:
            assert stats.ks_2samp(lam, cutmix_lambdas(alpha)).pvalue > 0.001, alpha
            assert stats.ks_2samp(lam, cutmix_lambdas(other)).pvalue < 0.001, "the test must tell alphas apart"


def test_a_run_with_every_augmentation_trains_and_validates(shards: Path, tmp_path: Path) -> None:
    """Mixup, cutmix, TrivialAugment, random erasing, EMA and the split train and val sizes in one
    split-mode run: every sample once an epoch, a finite loss, validation at the val crop."""
    cfg = small_config(
        shards, mode="split", epochs=2, auto_augment="ta_wide", random_erase=0.25, mixup_alpha=0.2,
        cutmix_alpha=1.0, model_ema=True, model_ema_steps=1, train_crop_size=24, val_crop_size=28,
        val_resize_size=36, out=str(tmp_path),
    )  # fmt: skip
    final = train(cfg, World(), run_dir=RunDir(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    assert [r["epoch_samples"] for r in epochs] == [120, 120] and all(r["epoch_duplicates"] == 0 for r in epochs)
    assert [r["image_size_px"] for r in epochs] == [24, 24]
    assert final["val_samples"] == 50 and 0 < final["train_loss"] < 10 and "val_top1_ema" in final
