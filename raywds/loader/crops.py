"""The training crop's draw: RandomResizedCrop's box and RandomHorizontalFlip's coin, from each
sample's own generator, seeded by (seed, epoch, sample id), so a sample gets the same crop
whichever loader worker, rank or Ray Data task decodes it, in any order.

    box, flip = draw_crop(375, 500, (0.08, 1.0), crop_rng(seed, epoch, sample_id))
"""

from __future__ import annotations

import math

import torch

from raywds.plan import seeds

RATIO = (3 / 4, 4 / 3)

Box = tuple[int, int, int, int]
"""top, left, height, width in the full image."""

_LOG_RATIO = torch.log(torch.tensor(RATIO)).tolist()  # float32-rounded, as get_params has them


def reduction(box: Box, size: int) -> int:
    """The largest libjpeg scale-down (1, 2, 4 or 8) that keeps the crop at least `size` on both sides."""
    _, _, h, w = box
    r = 8
    while r > 1 and min(h, w) < r * size:
        r //= 2
    return r


def crop_rng(seed: int, epoch: int, sample_id: int) -> torch.Generator:
    """The generator a training sample's crop and flip are drawn from, its own (about 3 us to make)."""
    rng = torch.Generator()
    rng.manual_seed(seeds.number(seeds.CROP, seed, epoch, sample_id))
    return rng


def draw_crop(
    height: int, width: int, scale: tuple[float, float], rng: torch.Generator | None = None
) -> tuple[Box, bool]:
    """RandomResizedCrop's box, then RandomHorizontalFlip's coin, drawn from `rng` (torch's
    global generator when None) exactly as torchvision draws them (`RandomResizedCrop.get_params`:
    the same calls, in the same order, on the same values), so a seed gives both the same crops.
    Written out because get_params builds tensors for what is scalar arithmetic, 3.3x slower
    (benchmarks/loader_bench.py). Every draw goes into one of two one-element tensors made
    here: `uniform_` and `random_` are what torch.rand and torch.randint call, without a new
    tensor each (a third of the draw's time)."""
    real, whole = torch.empty(1), torch.empty(1, dtype=torch.long)
    area = height * width
    for _ in range(10):
        target_area = area * real.uniform_(scale[0], scale[1], generator=rng).item()
        aspect_ratio = math.exp(real.uniform_(_LOG_RATIO[0], _LOG_RATIO[1], generator=rng).item())
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(whole.random_(0, height - h + 1, generator=rng).item())
            left = int(whole.random_(0, width - w + 1, generator=rng).item())
            return (top, left, h, w), real.uniform_(0, 1, generator=rng).item() < 0.5
    in_ratio = width / height  # ten misses: the centre crop get_params falls back to
    if in_ratio < min(RATIO):
        w, h = width, int(round(width / min(RATIO)))
    elif in_ratio > max(RATIO):
        h, w = height, int(round(height * max(RATIO)))
    else:
        w, h = width, height
    return ((height - h) // 2, (width - w) // 2, h, w), real.uniform_(0, 1, generator=rng).item() < 0.5
