"""Shards raywds did not write, as other tools write them, for `raywds index` and --data: seeded
and small, their images the demo's (raywds.data.demo.make_image), so a model can learn them.

    names = shardwriter_shards(tmp / "wds", num_samples=30, maxcount=8)    # train-0000.tar … (8, 8, 8, 6)
    names = png_shards(tmp / "png", label="name")                          # folder/key.png + .json
    hub = imagenet_wds(tmp / "hub")                                        # the Hub's imagenet-1k-wds
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from raywds.data.demo import CLASSES, make_image

NUM_CLASSES = 5
"""Demo classes the foreign shards use (of the demo's 10)."""
Members = list[tuple[str, bytes]]


def demo_images(
    num_samples: int, *, seed: int, side_px: int = 32, num_classes: int = NUM_CLASSES
) -> Iterator[tuple[int, bytes]]:
    """(class index, JPEG bytes) of `num_samples` demo images, the classes in turn."""
    for i in range(num_samples):
        label = i % num_classes
        yield label, make_image(label, np.random.default_rng([seed, i]), side_px)


def write_tar(path: Path, files: Members) -> Path:
    """A tar of `files` (name, data) in order, written by tarfile as most tools write them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def tar_keys(path: Path) -> list[str]:
    """The sample keys of a tar in order, as webdataset groups members: a member's name up to its
    file name's first dot (read with tarfile, not raywds)."""
    with tarfile.open(path) as tar:
        names = [m.name for m in tar if m.isreg()]
    return list(dict.fromkeys(n[: n.index(".", n.rfind("/") + 1)] for n in names))


# (a) webdataset.ShardWriter: jpg and cls, the last shard short.


def shardwriter_shards(
    out: Path,
    *,
    num_samples: int = 30,
    maxcount: int = 8,
    seed: int = 0,
    side_px: int = 32,
    prefix: str = "train",
    image: bytes | None = None,
) -> list[str]:
    """`prefix-0000.tar` … written by webdataset's ShardWriter (`jpg` and `cls` members), at most
    `maxcount` samples each, so the last is short (30 in 8s: 8, 8, 8, 6); the names in order.
    With `image`, every sample holds those JPEG bytes (large shards, made at once)."""
    import webdataset as wds

    out.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(out / f"{prefix}-%04d.tar"), maxcount=maxcount, verbose=0) as sink:
        made = (
            demo_images(num_samples, seed=seed, side_px=side_px)
            if image is None
            else ((i % NUM_CLASSES, b"") for i in range(num_samples))
        )
        for i, (label, jpeg) in enumerate(made):
            sink.write({"__key__": f"sample{i:06d}", "jpg": image or jpeg, "cls": str(label).encode()})
    return sorted(p.name for p in out.glob(f"{prefix}-*.tar"))


def shard_sizes(num_samples: int, maxcount: int) -> list[int]:
    """Samples per shard of `shardwriter_shards`."""
    return [min(maxcount, num_samples - start) for start in range(0, num_samples, maxcount)]


# (b) tarfile: png images, keys with a folder part, the label in a json member.


def png(jpeg: bytes) -> bytes:
    with Image.open(io.BytesIO(jpeg)) as img:
        out = io.BytesIO()
        img.convert("RGB").save(out, format="PNG")
        return out.getvalue()


def png_shards(
    out: Path,
    *,
    label: str = "name",
    sizes: Sequence[int] = (10, 10, 7),
    seed: int = 1,
    side_px: int = 32,
    prefix: str = "part",
) -> list[str]:
    """Shards `prefix-000.tar` … of `sizes` samples written with tarfile: `<class>/<key>.png` and
    `<class>/<key>.json`, the JSON's label by class name (`label="name"`: {"class": "disc"}) or by
    index (`label="index"`: {"label": 0}); the names in order."""
    names, i = [], 0
    images = demo_images(sum(sizes), seed=seed, side_px=side_px)
    for number, size in enumerate(sizes):
        files: Members = []
        for _ in range(size):
            index, jpeg = next(images)
            name = CLASSES[index][1]
            meta = {"class": name, "source": "tarfile"} if label == "name" else {"label": index, "name": name}
            files += [(f"{name}/img{i:05d}.png", png(jpeg)), (f"{name}/img{i:05d}.json", json.dumps(meta).encode())]
            i += 1
        names.append(write_tar(out / f"{prefix}-{number:03d}.tar", files).name)
    return names


CLASS_NAMES = sorted(CLASSES[i][1] for i in range(NUM_CLASSES))
"""The class names of `png_shards(label="name")`, as `raywds index` orders them (sorted)."""


# (c) The Hugging Face Hub's imagenet-1k-wds: jpg, cls, json, and timm's _info.json.

HUB_TRAIN = [9, 9, 9, 5]
HUB_VAL = [6, 4]
HUB_NUM_CLASSES = 8
"""_info.json's count, more than the labels the few samples use (0..4)."""


def imagenet_wds(out: Path, *, seed: int = 2, side_px: int = 32, info: bool = True) -> dict:
    """`imagenet1k-train-{0000..0003}.tar` and `imagenet1k-validation-{00..01}.tar` as the Hub's
    timm/imagenet-1k-wds holds them (keys like `n90000001_00012`, members jpg, cls and json), and
    its `_info.json` (timm's format) unless `info` is False; that `_info.json` as a dict."""
    splits = {}
    for split, sizes, width in (("train", HUB_TRAIN, 4), ("validation", HUB_VAL, 2)):
        images = demo_images(sum(sizes), seed=seed + len(split), side_px=side_px)
        filenames, i = [], 0
        for number, size in enumerate(sizes):
            files: Members = []
            for _ in range(size):
                label, jpeg = next(images)
                wnid = CLASSES[label][0]
                key = f"{wnid}_{i:05d}" if split == "train" else f"ILSVRC2012_val_{i:08d}"
                meta = {"filename": f"{key}.JPEG", "label": label, "class_name": CLASSES[label][1]}
                files += [
                    (f"{key}.jpg", jpeg),
                    (f"{key}.cls", str(label).encode()),
                    (f"{key}.json", json.dumps(meta).encode()),
                ]
                i += 1
            filenames.append(write_tar(out / f"imagenet1k-{split}-{number:0{width}d}.tar", files).name)
        splits[split] = {"name": split, "num_samples": sum(sizes), "filenames": filenames, "shard_lengths": list(sizes)}
    made = {"name": "imagenet-1k", "num_classes": HUB_NUM_CLASSES, "splits": splits}
    if info:
        (out / "_info.json").write_text(json.dumps(made))
    return made


# Shards of equal byte sizes: a swap that the size check at open cannot see.


def jpeg_of_size(jpeg: bytes, size: int) -> bytes:
    """The same JPEG padded to exactly `size` bytes with a comment segment (FFFE) after SOI."""
    room = size - len(jpeg) - 4
    if room < 0 or room > 65533:
        raise ValueError(f"a {len(jpeg)}-byte JPEG cannot be padded to {size} bytes with one comment")
    return jpeg[:2] + b"\xff\xfe" + (room + 2).to_bytes(2, "big") + b"\0" * room + jpeg[2:]


def equal_size_shards(
    out: Path, *, num_shards: int = 2, per_shard: int = 16, seed: int = 4, side_px: int = 32
) -> list[str]:
    """`same-{0000..}.tar` with `per_shard` samples each (jpg, cls), every JPEG padded to one size,
    so every shard has the same number of bytes and only its keys tell them apart."""
    images = list(demo_images(num_shards * per_shard, seed=seed, side_px=side_px))
    size = max(len(j) for _, j in images) + 64
    names = []
    for number in range(num_shards):
        files: Members = []
        for i in range(number * per_shard, (number + 1) * per_shard):
            label, jpeg = images[i]
            files += [(f"k{i:05d}.jpg", jpeg_of_size(jpeg, size)), (f"k{i:05d}.cls", str(label).encode())]
        names.append(write_tar(out / f"same-{number:04d}.tar", files).name)
    return names


def member_ends(path: Path) -> list[int]:
    """Where each member's data ends in the tar (padded to its 512-byte block): the member boundaries."""
    with tarfile.open(path) as tar:
        return [m.offset_data + -(-m.size // 512) * 512 for m in tar]
