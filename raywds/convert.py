"""ImageNet tree or ImageFolder -> WebDataset shards plus manifest.json.

    raywds convert ~/imagenet shards/ --maxcount 1000 --workers 8

SRC holds `train/<class>/*` and/or `val/<class>/*`; a folder with neither is one ImageFolder,
converted as the `train` split. Every sample keeps the source file's bytes unchanged
(`KEY.jpg`, or `.png`/`.webp`), with `KEY.cls` (class index, ASCII) and `KEY.json`.
Classes are indexed in sorted order, as torchvision's ImageFolder does.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import webdataset as wds
from PIL import Image
from tqdm import tqdm

from raywds.errors import DataError
from raywds.shards import FORMAT, MANIFEST, ShardInfo, write_json_atomic

SPLITS = ("train", "val")
IMAGE_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
# Tar layout: a 512-byte header per member, data padded to 512; .cls takes one block and
# .json at most two. Each archive ends with zero blocks, padded to tarfile's 10240-byte record.
TAR_END_BYTES = 10240


def tar_cost(num_bytes: int) -> int:
    """Upper bound of the bytes one sample adds to a shard."""
    return 3 * 512 + -(-num_bytes // 512) * 512 + 512 + 1024


@dataclass(frozen=True)
class Source:
    """One image to put in a shard."""

    path: Path
    relpath: str
    class_name: str
    class_index: int
    num_bytes: int


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """How to cut the shards."""

    maxcount: int = 1000
    """Most samples per shard."""
    maxsize: int = 1 << 30
    """Most bytes per shard (a lone sample larger than this still gets its own shard)."""
    num_workers: int = 1
    """Processes writing shards at once."""
    seed: int = 0
    """Seeds the sample shuffle before sharding."""
    prefix: str = "imagenet"
    """Shard names are PREFIX-SPLIT-NNNNNN.tar."""


def _image_files(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS:
            yield path


def scan(src: Path) -> tuple[list[str], dict[str, list[Source]]]:
    """Class names in index order, and the images of each split."""
    if not src.is_dir():
        raise DataError(f"input directory {src} does not exist; give the folder that holds train/ and val/")
    split_dirs = {s: src / s for s in SPLITS if (src / s).is_dir()} or {"train": src}
    first = split_dirs.get("train", next(iter(split_dirs.values())))
    classes = sorted(p.name for p in first.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{first} has no class folders; expected {first}/<class>/<image>.JPEG")
    index = {name: i for i, name in enumerate(classes)}
    found: dict[str, list[Source]] = {}
    for split, folder in split_dirs.items():
        sources = []
        for class_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
            if class_dir.name not in index:
                raise DataError(f"{class_dir} is a class that {first} lacks; the splits must share classes")
            for path in _image_files(class_dir):
                sources.append(
                    Source(path, str(path.relative_to(src)), class_dir.name, index[class_dir.name], path.stat().st_size)
                )
        if not sources:
            raise DataError(f"no images (.jpg .jpeg .png .webp) under {folder}")
        found[split] = sources
    return classes, found


def plan_shards(sources: list[Source], split: str, options: ConvertOptions) -> list[list[Source]]:
    """Shuffle with the seed, then cut into shards by count and size."""
    order = list(sources)
    random.Random(f"{options.seed}-{split}").shuffle(order)
    shards: list[list[Source]] = []
    current: list[Source] = []
    size = 0
    for source in order:
        cost = tar_cost(source.num_bytes)
        if current and (len(current) >= options.maxcount or size + cost + TAR_END_BYTES > options.maxsize):
            shards.append(current)
            current, size = [], 0
        current.append(source)
        size += cost
    if current:
        shards.append(current)
    return shards


def sample_key(source: Source) -> str:
    """A tar key from the file name: webdataset splits keys at the first dot."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", Path(source.relpath).with_suffix("").name)


def _describe(source: Source, data: bytes) -> dict[str, object]:
    meta: dict[str, object] = {"class": source.class_name, "index": source.class_index, "source": source.relpath}
    try:
        with Image.open(io.BytesIO(data)) as img:
            meta.update(format=img.format, mode=img.mode, width=img.width, height=img.height)
    except Exception as e:  # noqa: BLE001 - an unreadable image is reported, not fatal here
        meta["error"] = f"{type(e).__name__}: {e}"
    return meta


def write_shard(path: Path, sources: list[Source]) -> ShardInfo:
    """Write one shard to a temporary name, then rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    keys: set[str] = set()
    # mtime 0 makes shards reproducible; an int, since a float adds a PAX header to every member.
    with wds.TarWriter(str(tmp), mtime=0) as sink:
        for source in sources:
            data = source.path.read_bytes()
            key = sample_key(source)
            if key in keys:
                key = f"{source.class_name}_{key}"
            keys.add(key)
            sink.write(
                {
                    "__key__": key,
                    IMAGE_EXTENSIONS[source.path.suffix.lower()]: data,
                    "cls": str(source.class_index).encode(),
                    "json": json.dumps(_describe(source, data), sort_keys=True).encode(),
                }
            )
    digest = hashlib.sha256()
    with open(tmp, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    tmp.replace(path)
    return ShardInfo(path.name, len(sources), path.stat().st_size, digest.hexdigest())


def _write_job(job: tuple[Path, list[Source]]) -> ShardInfo:
    return write_shard(*job)


def convert(src: Path, out: Path, options: ConvertOptions = ConvertOptions()) -> dict[str, Any]:
    """Convert the tree at `src` into shards under `out`; returns the manifest it wrote."""
    if options.maxcount < 1 or options.maxsize < 1 or options.num_workers < 1:
        raise DataError(f"maxcount, maxsize and workers must be at least 1, got {options}")
    classes, splits = scan(src)
    out.mkdir(parents=True, exist_ok=True)
    jobs: list[tuple[str, Path, list[Source]]] = []
    for split, sources in splits.items():
        for i, shard in enumerate(plan_shards(sources, split, options)):
            jobs.append((split, out / f"{options.prefix}-{split}-{i:06d}.tar", shard))
    total = sum(len(s) for s in splits.values())
    infos: dict[Path, ShardInfo] = {}
    with tqdm(total=total, unit="img", desc="convert", disable=None) as bar:
        work = [(path, shard) for _, path, shard in jobs]
        if options.num_workers == 1:
            results: Iterator[ShardInfo] = map(_write_job, work)
            for (_, path, _), info in zip(jobs, results):
                infos[path] = info
                bar.update(info.num_samples)
        else:
            with multiprocessing.get_context("spawn").Pool(options.num_workers) as pool:
                for (_, path, _), info in zip(jobs, pool.imap(_write_job, work)):
                    infos[path] = info
                    bar.update(info.num_samples)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "prefix": options.prefix,
        "classes": classes,
        "seed": options.seed,
        "maxcount": options.maxcount,
        "maxsize": options.maxsize,
        "source": str(src.resolve()),
        "splits": {
            split: {
                "num_samples": len(sources),
                "shards": [infos[path].__dict__ for s, path, _ in jobs if s == split],
            }
            for split, sources in splits.items()
        },
    }
    write_json_atomic(out / MANIFEST, manifest)
    return manifest
