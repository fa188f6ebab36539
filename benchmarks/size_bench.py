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
   photos as they are (what an ImageFolder reads).

Each column is also set against its own 224 px rate (the goal: 128 px at >= 2x the 224 px rate
per worker), and the raywds loop against the PIL loop at the same size. A line under the table
gives one process's full `decode_jpeg` of each photo, the limit without DCT scaling.

The machine is shared and noisy, so the measurements are interleaved over `rounds` rounds (the
sizes in reverse order every other round) and the median is reported; compare ratios within one
run. With --markdown FILE the command, the machine and the table are written there as well.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from loader_bench import build_tree, loop_rate, photos, raywds_rate
from PIL import Image

from raywds.data.convert import ConvertOptions, convert, with_restarts
from raywds.loader import crops

SCALE = (0.08, 1.0)
SEED = 0
FACTORS = (1, 2, 4, 8)


def shape(data: bytes) -> tuple[int, int]:
    """A JPEG's height and width, from its header."""
    found = crops._jpeg.size(data) if crops._jpeg is not None else None
    if found is not None:
        return found
    with Image.open(io.BytesIO(data)) as img:
        return img.height, img.width


def crop_loop(datas: list[bytes], size: int) -> float:
    """raywds's `cpu` crop of every image, each drawn from its own generator as in the loader."""

    def one(item: tuple[int, bytes]) -> object:
        sample_id, data = item
        return crops.train_crop(data, size, SCALE, rng=crops.crop_rng(SEED, 0, sample_id))

    return loop_rate(list(enumerate(datas)), one)  # type: ignore[arg-type]


def shares(datas: list[bytes], size: int) -> dict[int, float]:
    """The fraction of `crop_loop`'s crops that decode at each DCT scale-down (1, 2, 4, 8)."""
    counts: Counter[int] = Counter()
    for sample_id, data in enumerate(datas):
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


def table(sizes: list[int], rate: dict[tuple[str, int], float], share: dict[int, dict[int, float]]) -> list[str]:
    top = max(sizes)
    lines = [
        f"| size | raywds crop img/s | vs its {top} px | raywds loader 1 worker img/s | vs its {top} px "
        "| PIL img/s | raywds/PIL | DCT scale shares (1 / 1/2 / 1/4 / 1/8) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size in sizes:
        crop, loader, pil = (rate[(what, size)] for what in ("crop", "loader", "pil"))
        scales = " / ".join(f"{share[size][r]:.0%}" for r in FACTORS)
        lines.append(
            f"| {size} | {crop:.0f} | {crop / rate[('crop', top)]:.2f}x | {loader:.0f} "
            f"| {loader / rate[('loader', top)]:.2f}x | {pil:.0f} | {crop / pil:.2f}x | {scales} |"
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
            f"{n} JPEGs ({len(images)} {kind} photos x {args.copies}), crop scale {SCALE}, batch 64, "
            f"{cores} cores ({cpu_model()}), median of {args.rounds} rounds"
        )
        print(header, flush=True)
        runs: dict[tuple[str, int], Callable[[], float]] = {}
        for size in sizes:
            runs[("crop", size)] = partial(crop_loop, stored, size)
            runs[("loader", size)] = partial(raywds_rate, root / "shards", 1, n, size, "cpu")
            runs[("pil", size)] = partial(loop_rate, originals, crops.reference_train(size, SCALE))
        limit_run = partial(loop_rate, originals, crops.jpeg_tensor)
        measured: dict[tuple[str, int], list[float]] = defaultdict(list)
        limits: list[float] = []
        for round_ in range(args.rounds):
            order = sizes if round_ % 2 == 0 else sizes[::-1]
            for size in order:
                for what in ("crop", "loader", "pil"):
                    measured[(what, size)].append(runs[(what, size)]())
            limits.append(limit_run())
            print(f"round {round_ + 1} of {args.rounds} done", flush=True)
        rate = {key: statistics.median(values) for key, values in measured.items()}
        share = {size: shares(stored, size) for size in sizes}
        limit = statistics.median(limits)
        lines = table(sizes, rate, share)
        spread = [
            "rounds' spread (min-max img/s): "
            + "; ".join(
                f"{size} px crop {min(measured[('crop', size)]):.0f}-{max(measured[('crop', size)]):.0f}, "
                f"loader {min(measured[('loader', size)]):.0f}-{max(measured[('loader', size)]):.0f}, "
                f"PIL {min(measured[('pil', size)]):.0f}-{max(measured[('pil', size)]):.0f}"
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
