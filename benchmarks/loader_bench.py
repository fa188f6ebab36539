"""Loader throughput on real ImageNet JPEGs against the decode limit and the usual alternative.

    .venv/bin/python benchmarks/loader_bench.py [--images ../shared/data/imagenet-sample-100] [--copies 10]

In one run, on the same images (`copies` x the sample, as an ImageFolder tree and as raywds
shards):
1. the limit: one process that only decodes each full JPEG to RGB, with
   torchvision.io.decode_jpeg and with PIL;
2. the usual alternative: torchvision ImageFolder + DataLoader with the standard train
   transform (RandomResizedCrop 224, flip, ToTensor, Normalize);
3. raywds's train loader (resample mode, same crop and flip; uint8 out, normalised later on
   the device);
2 and 3 with 1 DataLoader worker and with 2 (all cores here). Each loader pass is timed after
its first batch (worker start-up excluded), over one epoch's worth of images.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms

from raywds.config import TrainConfig
from raywds.convert import ConvertOptions, convert
from raywds.loader import epoch_plan, train_loader
from raywds.shards import read_manifest
from raywds.world import World

BATCH = 64


def build_tree(images: list[Path], copies: int, root: Path) -> int:
    for path in images:
        folder = root / "train" / path.name.split("_")[0]
        folder.mkdir(parents=True, exist_ok=True)
        for c in range(copies):
            shutil.copy(path, folder / f"{path.stem}_{c}.JPEG")
    return len(images) * copies


def decode_rate(datas: list[bytes], how: str) -> float:
    start = time.perf_counter()
    for data in datas:
        if how == "decode_jpeg":
            torchvision.io.decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=torchvision.io.ImageReadMode.RGB)
        else:
            with Image.open(io.BytesIO(data)) as img:
                img.convert("RGB")
    return len(datas) / (time.perf_counter() - start)


def timed(batches, num_images: int) -> float:
    """Images per second after the first batch, until `num_images` have arrived."""
    it = iter(batches)
    first = next(it)
    seen, start = 0, time.perf_counter()
    for batch in it:
        seen += len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch.keys)
        if seen + len(first[0]) >= num_images:
            break
    return seen / (time.perf_counter() - start)


def imagefolder_rate(root: Path, workers: int, num_images: int) -> float:
    transform = transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])  # fmt: skip
    dataset = torchvision.datasets.ImageFolder(str(root / "train"), transform=transform)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers, multiprocessing_context="fork", drop_last=True)
    return timed(loader, num_images)


def raywds_rate(shards: Path, workers: int, num_images: int) -> float:
    cfg = TrainConfig(data=str(shards), model="demo", batch_size_per_rank=BATCH, num_loader_workers_per_rank=workers, image_size_px=224)
    manifest = read_manifest(str(shards))
    return timed(train_loader(manifest, cfg, World(), epoch_plan(manifest, cfg, 1, epoch=0), epoch=0), num_images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100")
    parser.add_argument("--copies", type=int, default=10)
    args = parser.parse_args()
    images = sorted(args.images.glob("*.JPEG"))
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n = build_tree(images, args.copies, root / "tree")
        convert(root / "tree", root / "shards", ConvertOptions(maxcount=100, num_workers=2))
        print(f"{n} JPEGs ({len(images)} real ImageNet photos x {args.copies}), batch {BATCH}, 224 px crops")
        datas = [p.read_bytes() for p in images] * 3
        limit = {how: decode_rate(datas, how) for how in ("decode_jpeg", "PIL")}
        for how, rate in limit.items():
            print(f"limit, full decode, 1 process, {how:11s}: {rate:7.0f} images/s")
        rows = {}
        for workers in (1, 2):
            rows[("ImageFolder", workers)] = imagefolder_rate(root / "tree", workers, n)
            rows[("raywds", workers)] = raywds_rate(root / "shards", workers, n)
        for (name, workers), rate in rows.items():
            print(f"{name:11s} {workers} worker{'s' if workers > 1 else ' '}: {rate:7.0f} images/s  ({rate / workers:.0f} per worker)")
        best = max(limit.values())
        print(f"raywds / ImageFolder, 1 worker: {rows[('raywds', 1)] / rows[('ImageFolder', 1)]:.2f}x")
        print(f"raywds / ImageFolder, 2 workers: {rows[('raywds', 2)] / rows[('ImageFolder', 2)]:.2f}x")
        print(f"raywds 1 worker / fastest full decode ({max(limit, key=limit.get)}): {rows[('raywds', 1)] / best:.2f}x")
        print(f"raywds 2 workers / 1 worker: {rows[('raywds', 2)] / rows[('raywds', 1)]:.2f}x")
        print(f"ImageFolder 2 workers / 1 worker: {rows[('ImageFolder', 2)] / rows[('ImageFolder', 1)]:.2f}x")


if __name__ == "__main__":
    main()
