"""Loader throughput on real-size JPEGs against the decode limit and the usual alternative.

    ./run-venv && .venv/bin/python benchmarks/loader_bench.py [--images DIR] [--copies 10] [--rounds 3]
    .venv/bin/python benchmarks/loader_bench.py --scaling-only --workers 1,2,4,8,15 --copies 100   # 16 cores

On the same images (`copies` x the photos in DIR, by default ../shared/data/imagenet-sample-100;
without it, generated ~500x375 photo-like JPEGs), as an ImageFolder tree and as raywds shards:

1. the limit: one process that only decodes each full JPEG to RGB, with
   torchvision.io.decode_jpeg and with PIL; and the same loop with raywds's crop (no loader),
   with the region decoder (raywds.loader._jpeg) and without it (whole-image decoding);
2. the usual alternative: torchvision ImageFolder + DataLoader with the standard train
   transform (RandomResizedCrop 224, flip, ToTensor, Normalize);
3. raywds's train loader, `--decode cpu` (crop from the header, region and DCT-scaled
   decoding, uint8 out, normalised later on the device) and `--decode pil` (torchvision's
   PIL transform inside the raywds loader);
2 and 3 with 1 DataLoader worker and with all cores; then 1 worker at a low resolution (128 px,
as in progressive-resizing schedules), where DCT scaling applies to most crops; and raywds
in the training process itself (0 workers: no batches cross processes), and with 1 worker
handing every batch over in a fresh shared-memory block (as before raywds.loader.blocks). Also the
shards' tar members read by webdataset (tarfile) and by raywds.data.tars, and the crop draw by
torchvision's get_params and by raywds.loader.crops.draw_crop.

With `--workers 1,2,4,8,15` it also times raywds's `--decode cpu` loader at each count and
prints the speed-up over 1 worker, the fraction of linear scaling (speed-up / workers) and each
worker's rate against the full-decode limit (per core: the loader / workers / full decode); and,
beside it, the loader against as many full decodes at once, one a process (what that many cores
of this machine decode together), with those decodes' own fraction of linear scaling: where the
cores do not add up (two vCPUs on one physical core, a shared memory bus), no loader can either;
`--scaling-only` times nothing else but the limit. Give enough images for the most workers (`--copies 100`:
10,000 images, about ten batches of 64 per worker at 15).

After the scaling table, one line gives a sample's time in the 1-worker loader by the
loader's own clock (the stages `raywds doctor` reads: reading the shards, decoding with the crop
and resize, collating), the rest of its time, and a full decode's time beside them; and one
the 1-worker loader on shards converted with `--keep-jpeg-bytes` (the photos byte for byte,
without the restart markers the region decoder cuts a crop's rows and columns at) against the
default shards. The full decode is always of the photos as they are.

Loader passes are timed after their first batch (worker start-up excluded) over `copies` x
the photos. This machine is shared and noisy, so the measurements are interleaved over
`rounds` rounds and the median is reported; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torchvision
import webdataset as wds
from PIL import Image, ImageFilter
from torch.utils.data import DataLoader
from torchvision import transforms

from raywds.data.convert import ConvertOptions, convert, with_restarts
from raywds.data.manifest import read_manifest
from raywds.data.tars import members
from raywds.loader import crops
from raywds.loader.blocks import Blocks
from raywds.loader.clock import Spent
from raywds.loader.loader import train_loader
from raywds.loader.settings import DecodeName
from raywds.plan.modes import epoch_plan
from raywds.train.config import TrainConfig
from raywds.world import World

BATCH = 64
KEPT = "raywds cpu, 1w, 224, JPEG bytes kept"
"""The 1-worker loader on shards converted with --keep-jpeg-bytes (no restart markers)."""


def photos(folder: Path, out: Path, count: int = 100) -> list[Path]:
    """The JPEGs in `folder`, or `count` generated photo-like ~500x375 JPEGs (blurred noise)."""
    found = sorted(folder.glob("*.JPEG")) if folder.is_dir() else []
    if found:
        return found
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        size = (500, 375) if i % 4 else (375, 500)
        noise = rng.integers(0, 256, (size[1] // 4, size[0] // 4, 3), dtype=np.uint8)
        img = Image.fromarray(noise).resize(size, Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(1.5))
        img.save(out / f"n{i % 10:08d}_{i}.JPEG", quality=90)
    return sorted(out.glob("*.JPEG"))


def build_tree(images: list[Path], copies: int, root: Path) -> int:
    for path in images:
        folder = root / "train" / path.name.split("_")[0]
        folder.mkdir(parents=True, exist_ok=True)
        for c in range(copies):
            shutil.copy(path, folder / f"{path.stem}_{c}.JPEG")
    return len(images) * copies


def loop_rate(datas: list[bytes], fn: Callable[[bytes], object]) -> float:
    start = time.perf_counter()
    for data in datas:
        fn(data)
    return len(datas) / (time.perf_counter() - start)


def parallel_loop_rate(datas: list[bytes], fn: Callable[[bytes], object], processes: int) -> float:
    """`processes` loops of `fn` over `datas` at once, one a forked process, started together: their
    images/s together, from the start to the last one's end. With the full decode it is what that
    many cores of this machine decode, the limit for as many loader workers: two vCPUs that share a
    physical core, or the memory bus, do less than twice one."""
    context = mp.get_context("fork")
    ready, ends = context.Barrier(processes + 1), context.Queue()

    def loop() -> None:
        ready.wait()
        for data in datas:
            fn(data)
        ends.put(time.perf_counter())  # CLOCK_MONOTONIC: the same clock in every process

    children = [context.Process(target=loop) for _ in range(processes)]
    for child in children:
        child.start()
    ready.wait()
    start = time.perf_counter()
    last = max(ends.get(timeout=600) for _ in children)
    for child in children:
        child.join(timeout=60)
    return processes * len(datas) / (last - start)


def whole_image_crop(data: bytes) -> object:
    """raywds's crop as it runs where raywds.loader._jpeg was not built."""
    saved, crops._jpeg = crops._jpeg, None  # type: ignore[assignment]
    try:
        return crops.train_crop(data, 224, (0.08, 1.0))
    finally:
        crops._jpeg = saved


def draw_rate(draw: Callable[[int, int], object], count: int = 3000) -> float:
    """Crop draws per second for a 500x375 image."""
    start = time.perf_counter()
    for _ in range(count):
        draw(375, 500)
    return count / (time.perf_counter() - start)


def torchvision_draw(height: int, width: int) -> object:
    """The draw as torchvision's transforms make it: get_params, then the flip's coin."""
    box = transforms.RandomResizedCrop.get_params(
        torch.empty(1, 1, 1).expand(3, height, width), [0.08, 1.0], [3 / 4, 4 / 3]
    )
    return box, bool(torch.rand(1) < 0.5)


def tar_rate(shards: list[Path], read: Callable[[io.BufferedReader], Iterable[object]]) -> float:
    """Samples per second (3 members each: image, class, metadata) through a tar reader."""
    start, count = time.perf_counter(), 0
    for path in shards:
        with open(path, "rb") as stream:
            count += sum(1 for _ in read(stream))
    return count / 3 / (time.perf_counter() - start)


def timed(batches, num_images: int, clocks: list[Spent] | None = None) -> float:
    """Images per second after the first batch, until `num_images` have arrived; with `clocks`,
    also what the loader's workers say they spent on those batches (their `Spent`), appended."""
    it = iter(batches)
    first = next(it)
    seen, start, spent = 0, time.perf_counter(), Spent()
    for batch in it:
        seen += len(batch[0])
        if clocks is not None and batch.spent is not None:
            spent = spent.plus(batch.spent)
        if seen + len(first[0]) >= num_images:
            break
    elapsed = time.perf_counter() - start
    if clocks is not None:
        clocks.append(spent)
    return seen / elapsed


def imagefolder_rate(root: Path, workers: int, num_images: int, size: int) -> float:
    transform = transforms.Compose(
        [
            transforms.RandomResizedCrop(size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    dataset = torchvision.datasets.ImageFolder(str(root / "train"), transform=transform)
    loader = DataLoader(
        dataset, batch_size=BATCH, shuffle=True, num_workers=workers, multiprocessing_context="fork", drop_last=True
    )
    return timed(loader, num_images)


def raywds_rate(
    shards: Path,
    workers: int,
    num_images: int,
    size: int,
    how: DecodeName,
    reuse_blocks: bool = True,
    clocks: list[Spent] | None = None,
) -> float:
    if not reuse_blocks:  # no block to reuse, so every batch goes into a fresh one (the workers fork from here)
        saved, Blocks.take = Blocks.take, lambda self, shape: None  # type: ignore[method-assign]
        try:
            return raywds_rate(shards, workers, num_images, size, how)
        finally:
            Blocks.take = saved  # type: ignore[method-assign]
    cfg = TrainConfig(
        data=str(shards),
        model="demo",
        batch_size=BATCH,
        loader_workers=workers,
        image_size=size,
        decode=how,
    )
    manifest = read_manifest(str(shards))
    batches = train_loader(manifest, cfg.loader(), World(), epoch_plan(manifest, cfg, 1, epoch=0), epoch=0)
    return timed(batches, num_images, clocks)


def print_clock(clocks: list[Spent], rate: float, limit: float) -> None:
    """Where one loader worker's time goes, a sample at a time, by the loader's own clock (the
    stages the doctor reads), summed over every round; the rest is the 1-worker time a sample
    that no stage counts (shuffling, the stages' own steps, waiting to hand a batch over)."""
    spent = clocks[0]
    for more in clocks[1:]:
        spent = spent.plus(more)
    if not spent.samples:
        return
    read, decoded, resized, collated = (
        1e6 * s / spent.samples for s in (spent.read_s, spent.decode_s, spent.resize_s, spent.collate_s)
    )
    rest = 1e6 / rate - read - decoded - collated
    print(
        f"one worker, a sample by the loader's own clock: reading {read:.0f} us, decoding {decoded:.0f} us "
        f"(of it resizing {resized:.0f}), collating {collated:.0f} us, the rest {rest:.0f} us; "
        f"a full decode_jpeg {1e6 / limit:.0f} us"
    )


def print_scaling(rates: dict[int, float], limit: float, limits: dict[int, float]) -> None:
    """raywds's loader at each worker count against 1 worker, against linear scaling, each worker
    (each core) against the full-decode rate of one process, and the loader against as many full
    decodes at once (`limits`: what that many cores decode together), with those decodes' own
    scaling: how far this machine's cores add up."""
    print(
        "scaling, raywds --decode cpu, 224 px (median images/s; speed-up over 1 worker; speed-up / workers; "
        "images/s per worker / full decode_jpeg; against as many full decodes at once, and their own of linear):"
    )
    print(
        f"  {'workers':>7s} {'images/s':>9s} {'speed-up':>9s} {'of linear':>10s} {'per core / full decode':>23s}"
        f" {'/ as many full decodes':>23s} {'full decodes, of linear':>24s}"
    )
    for workers, value in rates.items():
        speedup, together = value / rates[1], limits.get(workers, limit)
        print(
            f"  {workers:7d} {value:9.0f} {speedup:8.2f}x {speedup / workers:10.0%} {value / workers / limit:22.2f}x"
            f" {value / together:22.2f}x {together / workers / limit:24.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    )
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--workers", help="worker counts for the scaling table, e.g. 1,2,4,8,15 (default: 1 and all cores)"
    )
    parser.add_argument("--scaling-only", action="store_true", help="time only the scaling table's loaders")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0))
    counts = sorted({1, *(int(w) for w in args.workers.split(","))} if args.workers else {1, cores})
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        images = photos(args.images, root / "generated")
        n = build_tree(images, args.copies, root / "tree")
        convert(root / "tree", root / "shards", ConvertOptions(maxcount=100, workers=cores))
        kept = ConvertOptions(maxcount=100, workers=cores, keep_jpeg_bytes=True)
        convert(root / "tree", root / "shards-kept", kept)  # the JPEGs byte for byte: no restart markers
        kind = "generated" if images[0].is_relative_to(root) else "real ImageNet"
        print(
            f"{n} JPEGs ({len(images)} {kind} photos x {args.copies}), batch {BATCH}, {cores} cores, "
            f"median of {args.rounds} rounds"
        )
        datas = [p.read_bytes() for p in images] * 3
        scaling = {w: f"raywds cpu, {w}w, 224" for w in counts}
        clocks: list[Spent] = []  # the 1-worker loader's own clock, each round
        runs: dict[str, Callable[[], float]] = {
            "limit: full decode, decode_jpeg": partial(loop_rate, datas, crops.jpeg_tensor),
            "limit: full decode, PIL": partial(loop_rate, datas, crops.open_rgb),
            "loop: raywds crop (cpu), 224": partial(
                loop_rate, datas, partial(crops.train_crop, size=224, scale=(0.08, 1.0))
            ),
            "loop: same, whole-image decoding": partial(loop_rate, datas, whole_image_crop),
            "loop: same, the JPEGs as convert stores them": partial(
                loop_rate, [with_restarts(d) for d in datas], partial(crops.train_crop, size=224, scale=(0.08, 1.0))
            ),
        }
        runs["draw: torchvision get_params (crops/s)"] = partial(draw_rate, torchvision_draw)
        runs["draw: raywds draw_crop (crops/s)"] = partial(draw_rate, partial(crops.draw_crop, scale=(0.08, 1.0)))
        tars = sorted((root / "shards").glob("*train-*.tar"))
        runs["tar members, webdataset (samples/s)"] = partial(tar_rate, tars, wds.tariterators.tar_file_iterator)
        runs["tar members, raywds.data.tars (samples/s)"] = partial(tar_rate, tars, members)
        for workers in sorted({1, cores}):
            runs[f"ImageFolder, {workers}w, 224"] = partial(imagefolder_rate, root / "tree", workers, n, 224)
            runs[f"raywds cpu, {workers}w, 224"] = partial(
                raywds_rate, root / "shards", workers, n, 224, "cpu", clocks=clocks if workers == 1 else None
            )
            runs[f"raywds pil, {workers}w, 224"] = partial(raywds_rate, root / "shards", workers, n, 224, "pil")
        runs["raywds cpu, 1w, fresh blocks, 224"] = partial(
            raywds_rate, root / "shards", 1, n, 224, "cpu", reuse_blocks=False
        )
        runs["raywds cpu, 0w (in-process), 224"] = partial(raywds_rate, root / "shards", 0, n, 224, "cpu")
        runs[KEPT] = partial(raywds_rate, root / "shards-kept", 1, n, 224, "cpu")
        runs["ImageFolder, 1w, 128"] = partial(imagefolder_rate, root / "tree", 1, n, 128)
        runs["raywds cpu, 1w, 128"] = partial(raywds_rate, root / "shards", 1, n, 128, "cpu")
        for workers, name in scaling.items():
            runs.setdefault(name, partial(raywds_rate, root / "shards", workers, n, 224, "cpu"))
        together = {w: f"limit: {w} full decodes at once" for w in counts if w > 1}
        for workers, name in together.items():
            runs[name] = partial(parallel_loop_rate, datas, crops.jpeg_tensor, workers)
        if args.scaling_only:
            runs = {
                name: runs[name]
                for name in ["limit: full decode, decode_jpeg", *together.values(), *scaling.values(), KEPT]
            }
        measured = defaultdict(list)
        for _ in range(args.rounds):
            for name, run in runs.items():
                measured[name].append(run())
        rate = {name: statistics.median(values) for name, values in measured.items()}
        for name, value in rate.items():
            spread = f"{min(measured[name]):.0f}-{max(measured[name]):.0f}"
            print(f"{name:34s} {value:7.0f} images/s  (rounds: {spread})")
        limit = rate["limit: full decode, decode_jpeg"]
        print_scaling(
            {w: rate[name] for w, name in scaling.items()}, limit, {w: rate[name] for w, name in together.items()}
        )
        print_clock(clocks, rate["raywds cpu, 1w, 224"], limit)
        print(
            "1 worker, restart markers (convert's default) / JPEG bytes kept: "
            f"{rate['raywds cpu, 1w, 224'] / rate[KEPT]:.2f}x"
            f" (kept: {rate[KEPT] / limit:.2f}x the full decode)"
        )
        if args.scaling_only:
            return
        all_w = f"{cores}w"
        print("ratios (per core = 1 worker):")
        print(
            "  raywds / ImageFolder, 1 worker:        "
            f"{rate['raywds cpu, 1w, 224'] / rate['ImageFolder, 1w, 224']:.2f}x"
        )
        print(
            f"  raywds / ImageFolder, {cores} workers:       "
            f"{rate[f'raywds cpu, {all_w}, 224'] / rate[f'ImageFolder, {all_w}, 224']:.2f}x"
        )
        print(f"  raywds 1 worker / full decode_jpeg:   {rate['raywds cpu, 1w, 224'] / limit:.2f}x")
        print(f"  raywds crop loop / full decode_jpeg:  {rate['loop: raywds crop (cpu), 224'] / limit:.2f}x")
        stored = rate["loop: same, the JPEGs as convert stores them"]
        print(f"  the same on the JPEGs as convert stores them: {stored / limit:.2f}x")
        print(
            "  crop loop, region / whole-image decoding: "
            f"{rate['loop: raywds crop (cpu), 224'] / rate['loop: same, whole-image decoding']:.2f}x"
        )
        print(
            f"  raywds {cores} workers / 1 worker:          "
            f"{rate[f'raywds cpu, {all_w}, 224'] / rate['raywds cpu, 1w, 224']:.2f}x"
        )
        print(f"  raywds in-process / full decode_jpeg: {rate['raywds cpu, 0w (in-process), 224'] / limit:.2f}x")
        own = 1e6 / rate["raywds cpu, 0w (in-process), 224"] - 1e6 / rate["loop: raywds crop (cpu), 224"]
        print(  # reading, shuffling, batching: what a worker spends on a sample besides its crop
            f"  the loader's own time a sample (in-process loader - crop loop): {own:.0f} us "
            f"of a full decode's {1e6 / limit:.0f} us"
        )
        print(
            f"  raywds cpu / raywds pil, 1 worker:    {rate['raywds cpu, 1w, 224'] / rate['raywds pil, 1w, 224']:.2f}x"
        )
        print(
            f"  at 128 px, raywds / ImageFolder:      {rate['raywds cpu, 1w, 128'] / rate['ImageFolder, 1w, 128']:.2f}x"
        )
        print(f"  at 128 px, raywds / full decode_jpeg: {rate['raywds cpu, 1w, 128'] / limit:.2f}x")
        print(
            "  reused / fresh shared-memory blocks, 1 worker: "
            f"{rate['raywds cpu, 1w, 224'] / rate['raywds cpu, 1w, fresh blocks, 224']:.2f}x"
        )
        print(
            "  crop draw, raywds / torchvision:      "
            f"{rate['draw: raywds draw_crop (crops/s)'] / rate['draw: torchvision get_params (crops/s)']:.2f}x"
        )
        print(
            "  tar members, raywds.data.tars / webdataset: "
            f"{rate['tar members, raywds.data.tars (samples/s)'] / rate['tar members, webdataset (samples/s)']:.2f}x"
        )


if __name__ == "__main__":
    main()
