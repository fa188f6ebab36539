"""The embedded demo dataset: a small generated ImageNet-layout tree whose classes can be learned.

    raywds demo --out runs/demo/images      # train/<wnid>/*.JPEG and val/<wnid>/*.JPEG

Each class is a shape or texture in a class colour (jittered), drawn at a random place and
size over a noisy background, then JPEG-encoded. The same seed gives the same pixels.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

# (fake synset id, name, base colour). Every pattern is symmetric under a horizontal flip,
# so the usual flip augmentation never turns one class into another.
CLASSES: list[tuple[str, str, tuple[int, int, int]]] = [
    ("n90000001", "disc", (220, 40, 40)),
    ("n90000002", "square", (40, 180, 60)),
    ("n90000003", "triangle", (50, 80, 220)),
    ("n90000004", "hstripes", (230, 210, 40)),
    ("n90000005", "vstripes", (200, 60, 200)),
    ("n90000006", "checker", (40, 200, 210)),
    ("n90000007", "cross", (240, 140, 30)),
    ("n90000008", "ring", (235, 235, 235)),
    ("n90000009", "dots", (120, 60, 170)),
    ("n90000010", "diamond", (130, 130, 130)),
]


@dataclass(frozen=True, kw_only=True)
class DemoSpec:
    """How many demo images to make, and how."""

    num_train_per_class: int = 120
    """Training images per class."""
    num_val_per_class: int = 30
    """Validation images per class."""
    image_side_px: int = 64
    """Width and height of every image."""
    seed: int = 0
    """Same seed, same images."""


def _jitter(rng: np.random.Generator, colour: tuple[int, int, int], amount: int = 35) -> tuple[int, int, int]:
    c = np.clip(np.array(colour) + rng.integers(-amount, amount + 1, size=3), 0, 255)
    return (int(c[0]), int(c[1]), int(c[2]))


def _draw(
    pattern: str, draw: ImageDraw.ImageDraw, rng: np.random.Generator, side: int, fill: tuple[int, int, int]
) -> None:
    size = int(rng.integers(side * 4 // 10, side * 8 // 10))
    x0 = int(rng.integers(0, side - size + 1))
    y0 = int(rng.integers(0, side - size + 1))
    x1, y1 = x0 + size, y0 + size
    cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
    thick = max(2, size // 6)
    if pattern == "disc":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif pattern == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    elif pattern == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
    elif pattern == "hstripes":
        for y in range(y0, y1, 2 * thick):
            draw.rectangle((x0, y, x1, y + thick - 1), fill=fill)
    elif pattern == "vstripes":
        for x in range(x0, x1, 2 * thick):
            draw.rectangle((x, y0, x + thick - 1, y1), fill=fill)
    elif pattern == "checker":
        cell = max(3, size // 5)
        for i, y in enumerate(range(y0, y1, cell)):
            for j, x in enumerate(range(x0, x1, cell)):
                if (i + j) % 2 == 0:
                    draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=fill)
    elif pattern == "cross":
        draw.rectangle((cx - thick, y0, cx + thick, y1), fill=fill)
        draw.rectangle((x0, cy - thick, x1, cy + thick), fill=fill)
    elif pattern == "ring":
        draw.ellipse((x0, y0, x1, y1), outline=fill, width=thick)
    elif pattern == "dots":
        for _ in range(int(rng.integers(5, 10))):
            r = int(rng.integers(2, 5))
            x, y = (int(v) for v in rng.integers(r, side - r, size=2))
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
    elif pattern == "diamond":
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)
    else:
        raise ValueError(f"unknown demo pattern {pattern!r}")


def make_image(class_index: int, rng: np.random.Generator, side: int = 64) -> bytes:
    """One demo image of class `class_index`, as JPEG bytes."""
    _, pattern, colour = CLASSES[class_index]
    background = rng.integers(0, 90, size=3)
    pixels = background + rng.normal(0, 18, size=(side, side, 3))
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    _draw(pattern, ImageDraw.Draw(img), rng, side, _jitter(rng, colour))
    noisy = np.asarray(img, dtype=np.float32) + rng.normal(0, 12, size=(side, side, 3))
    out = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB").save(out, format="JPEG", quality=90)
    return out.getvalue()


def write_tree(out: Path, spec: DemoSpec = DemoSpec()) -> Path:
    """Write `out/train/<wnid>/*.JPEG` and `out/val/<wnid>/*.JPEG`; returns `out`."""
    counts = {"train": spec.num_train_per_class, "val": spec.num_val_per_class}
    for split_index, (split, count) in enumerate(counts.items()):
        for class_index, (wnid, _, _) in enumerate(CLASSES):
            folder = out / split / wnid
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                rng = np.random.default_rng([spec.seed, split_index, class_index, i])
                name = f"{wnid}_{i:05d}.JPEG" if split == "train" else f"DEMO_val_{class_index:02d}{i:05d}.JPEG"
                (folder / name).write_bytes(make_image(class_index, rng, spec.image_side_px))
    return out


def prepare(workdir: Path, spec: DemoSpec = DemoSpec()) -> Path:
    """Generate and convert the demo once under `workdir`; returns the shard directory.

    A finished conversion (its manifest exists) is reused, so reruns start training at once."""
    from raywds.data.convert import ConvertOptions, convert
    from raywds.data.manifest import MANIFEST

    shards = workdir / "shards"
    if (shards / MANIFEST).is_file():
        return shards
    images = write_tree(workdir / "images", spec)
    # Small shards so that 2 ranks x 2 loader workers all get some of each split.
    convert(images, shards, ConvertOptions(maxcount=50, seed=spec.seed))
    return shards
