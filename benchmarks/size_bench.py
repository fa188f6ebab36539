"""Training-crop size against images/s per loader worker: what DCT-scaled JPEG decoding buys at
the small crops of progressive resizing's early epochs.

    .venv/bin/python benchmarks/size_bench.py [--images DIR] [--copies 20] [--rounds 3]
        [--sizes 128,160,192,224] [--markdown FILE]

On the same images (`copies` x the photos in DIR, by default ../shared/data/imagenet-sample-100;
without it, generated ~500x375 photo-like JPEGs), for each training crop side in --sizes, crop
scale (0.08, 1.0), one thread for torch:

1. raywds's `--decode cpu` crop (raywds.loader.crops.train_crop) in a bare loop in this process,
   on the JPEGs as `raywds convert` stores them (with restart markers): what one loader worker
   decodes and crops a second. Each image's crop is drawn from its own generator
   (crops.crop_rng, as in the loader), so every size crops the same boxes and only the output
   side differs; the share of those crops decoded at 1, 1/2, 1/4 and 1/8 scale is counted
   from crops.reduction (the largest scale-down that leaves the crop at least the output side);
2. raywds's real train loader, `--decode cpu`, batch 64, 1 DataLoader worker, on shards converted
   from the same photos (loader_bench.raywds_rate: timed after the first batch), so reading the
   shards, batching and handing batches over are counted too;
3. the baseline: torchvision's PIL transform (RandomResizedCrop(size), RandomHorizontalFlip,
   PILToTensor: crops.reference_train, the `pil` decoder) in a bare loop in this process, on the
   photos as they are (what an ImageFolder reads);
4. 1 again with DCT scaling off (crops.reduction patched to 1: every crop decoded at full scale
   and resized by torch's uint8 kernel), the same boxes: what the scaling itself buys.

Each column is also set against its own 224 px rate (the goal: 128 px at >= 2x the 224 px rate
per worker), and the raywds loop against the PIL loop at the same size. A line under the table
gives one process's full `decode_jpeg` of each photo, the limit without DCT scaling.

The machine is shared and noisy and its speed drifts within seconds, so the bare loops (1, 3, 4
and the full decode, every size) take turns 50 images at a time, and each of `rounds` rounds
runs them all over every image, then the loader at each size (in reverse order every other
round); the median of the rounds is reported. Compare ratios within one run. With --markdown
FILE the command, the machine and the table are written there as well.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from loader_bench import BATCH, build_tree, photos, raywds_rate
from PIL import Image

from raywds.data.convert import ConvertOptions, convert, with_restarts
from raywds.loader import crops

SCALE = (0.08, 1.0)
SEED = 0
FACTORS = (1, 2, 4, 8)
WHAT = ("crop", "unscaled", "loader", "pil")
CHUNK = 50
"""Samples each bare loop decodes before the next loop's turn (`interleaved`)."""
LIMIT = ("limit", 0)

Key = tuple[str, int]
"""What is timed (WHAT, or "limit") and the crop side."""


def shape(data: bytes) -> tuple[int, int]:
    """A JPEG's height and width, from its header."""
    found = crops._jpeg.size(data) if crops._jpeg is not None else None
    if found is not None:
        return found
    with Image.open(io.BytesIO(data)) as img:
        return img.height, img.width


Sample = tuple[int, bytes, bytes]
"""A sample id, its JPEG as `raywds convert` stores it, and the photo as it is."""


def full_scale(box: crops.Box, size: int) -> int:
    """crops.reduction with DCT scaling off."""
    return 1


def raywds_crop(size: int, scaled: bool, sample: Sample) -> object:
    """raywds's `cpu` crop of the stored JPEG, drawn from the sample's own generator as in the
    loader; with `scaled` False, decoded at full scale whatever the crop (crops.reduction is 1)."""
    sample_id, data, _ = sample
    if scaled:
        return crops.train_crop(data, size, SCALE, rng=crops.crop_rng(SEED, 0, sample_id))
    saved, crops.reduction = crops.reduction, full_scale  # type: ignore[assignment]
    try:
        return crops.train_crop(data, size, SCALE, rng=crops.crop_rng(SEED, 0, sample_id))
    finally:
        crops.reduction = saved


def on_photo(fn: Callable[[bytes], object], sample: Sample) -> object:
    """`fn` of the photo as it is (what an ImageFolder reads)."""
    return fn(sample[2])


def interleaved(samples: list[Sample], fns: dict[Key, Callable[[Sample], object]]) -> dict[Key, float]:
    """Each of `fns` over every sample, images/s: all of them over the first CHUNK samples (in an
    order that rotates from chunk to chunk), then over the next CHUNK, so that the machine's
    drift over seconds falls on every one alike."""
    keys, spent = list(fns), dict.fromkeys(fns, 0.0)
    for i, first in enumerate(range(0, len(samples), CHUNK)):
        part = samples[first : first + CHUNK]
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
            fn, start = fns[key], time.perf_counter()
            for sample in part:
                fn(sample)
            spent[key] += time.perf_counter() - start
    return {key: len(samples) / seconds for key, seconds in spent.items()}


def shares(datas: list[bytes], size: int) -> dict[int, float]:
    """The fraction of `raywds_crop`'s crops that decode at each DCT scale-down (1, 2, 4, 8)."""
    counts: Counter[int] = Counter()
    for sample_id, data in enumerate(datas):  # the draws raywds_crop makes
        box, _ = crops.draw_crop(*shape(data), SCALE, crops.crop_rng(SEED, 0, sample_id))
        counts[crops.reduction(box, size)] += 1
    return {r: counts[r] / len(datas) for r in FACTORS}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(sizes: list[int], rate: dict[Key, float], share: dict[int, dict[int, float]]) -> list[str]:
    top = max(sizes)
    lines = [
        f"| size | raywds crop img/s | vs its {top} px | raywds loader 1 worker img/s | vs its {top} px "
        "| PIL img/s | raywds/PIL | DCT scale shares (1 / 1/2 / 1/4 / 1/8) "
        "| raywds crop, DCT scaling off img/s | DCT scaling on/off |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size in sizes:
        crop, unscaled, loader, pil = (rate[(what, size)] for what in WHAT)
        scales = " / ".join(f"{share[size][r]:.0%}" for r in FACTORS)
        lines.append(
            f"| {size} | {crop:.0f} | {crop / rate[('crop', top)]:.2f}x | {loader:.0f} "
            f"| {loader / rate[('loader', top)]:.2f}x | {pil:.0f} | {crop / pil:.2f}x | {scales} "
            f"| {unscaled:.0f} | {crop / unscaled:.2f}x |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    )
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="128,160,192,224", help="training crop sides, comma-separated")
    parser.add_argument("--markdown", type=Path, help="also write the command, machine and table here")
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        images = photos(args.images, root / "generated")
        n = build_tree(images, args.copies, root / "tree")
        convert(root / "tree", root / "shards", ConvertOptions(maxcount=100, workers=cores))
        kind = "generated" if images[0].is_relative_to(root) else "real ImageNet"
        originals = [p.read_bytes() for p in images] * args.copies
        stored = [with_restarts(d) for d in originals]  # what the loader's shards hold
        header = (
            f"{n} JPEGs ({len(images)} {kind} photos x {args.copies}), crop scale {SCALE}, batch {BATCH}, "
            f"{cores} cores ({cpu_model()}), median of {args.rounds} rounds"
        )
        print(header, flush=True)
        samples = list(zip(range(n), stored, originals, strict=True))
        bare: dict[Key, Callable[[Sample], object]] = {LIMIT: partial(on_photo, crops.jpeg_tensor)}
        for size in sizes:
            bare[("crop", size)] = partial(raywds_crop, size, True)
            bare[("unscaled", size)] = partial(raywds_crop, size, False)
            bare[("pil", size)] = partial(on_photo, crops.reference_train(size, SCALE))
        measured: dict[Key, list[float]] = defaultdict(list)
        for round_ in range(args.rounds):
            for key, value in interleaved(samples, bare).items():
                measured[key].append(value)
            for size in sizes if round_ % 2 == 0 else sizes[::-1]:
                measured[("loader", size)].append(raywds_rate(root / "shards", 1, n, size, "cpu"))
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)
        rate = {key: statistics.median(values) for key, values in measured.items()}
        share = {size: shares(stored, size) for size in sizes}
        limit, limits = rate[LIMIT], measured[LIMIT]
        lines = table(sizes, rate, share)
        spread = [
            "rounds' spread (min-max img/s): "
            + "; ".join(
                f"{size} px "
                + ", ".join(
                    f"{what} {min(measured[(what, size)]):.0f}-{max(measured[(what, size)]):.0f}" for what in WHAT
                )
                for size in sizes
            ),
            f"limit: one process's full decode_jpeg of each photo {limit:.0f} img/s "
            f"(rounds {min(limits):.0f}-{max(limits):.0f}); "
            + ", ".join(f"{size} px crop / it {rate[('crop', size)] / limit:.2f}x" for size in sizes),
        ]
        if 224 in sizes and 128 in sizes:
            goal = rate[("loader", 128)] / rate[("loader", 224)]
            spread.append(
                f"goal, 128 px >= 2x the 224 px rate per worker: loader {goal:.2f}x "
                f"({'met' if goal >= 2 else 'not met'}), bare crop loop "
                f"{rate[('crop', 128)] / rate[('crop', 224)]:.2f}x"
            )
        print("\n".join(["", *lines, "", *spread]))
        if args.markdown:
            command = " ".join([".venv/bin/python", "benchmarks/size_bench.py", *sys.argv[1:]])
            text = [
                "```bash",
                command,
                "```",
                "",
                f"- Machine: {cores} cores (nproc), {cpu_model()}, Python {platform.python_version()}, "
                f"torch {torch.__version__}",
                f"- {header}",
                "",
                *lines,
                "",
                *(f"- {line}" for line in spread),
                "",
            ]
            args.markdown.write_text("\n".join(text))


if __name__ == "__main__":
    main()
