"""What `--verify-hashes` costs: shards read with and without streaming each one's sha256.

    ./run-venv && .venv/bin/python benchmarks/verify_bench.py [--images DIR] [--copies 10] [--rounds 5]

On `copies` x the photos in DIR (by default ../shared/data/imagenet-sample-100; generated
photo-like JPEGs without it) converted to shards of 100 samples, two pairs of rows, each pair
interleaved over `rounds` rounds (medians; this machine is shared, so compare ratios within a run):

1. reading alone: the shards' samples through `raywds.loader.readers.tar_samples` (tar members,
   key grouping, the manifest checks), no decoding: the upper bound of the cost;
2. the training loader, split mode, 1 DataLoader worker, 224 px crops (`--decode cpu`): what
   a training run sees.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from loader_bench import BATCH, build_tree, photos, timed

from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import read_manifest
from raywds.loader.loader import expected, train_loader
from raywds.loader.readers import ReadPolicy, tar_samples
from raywds.plan.modes import epoch_plan
from raywds.train.config import TrainConfig
from raywds.world import World


def read_rate(shards: Path, verify: bool) -> float:
    """Samples per second through the shard reader alone."""
    manifest = read_manifest(str(shards))
    urls = [{"url": manifest.url(s)} for s in manifest.shards("train")]
    start = time.perf_counter()
    count = sum(1 for _ in tar_samples(urls, ReadPolicy(), expected(manifest, "train"), verify_hashes=verify))
    return count / (time.perf_counter() - start)


def loader_rate(shards: Path, verify: bool, num_images: int) -> float:
    cfg = TrainConfig(
        data=str(shards),
        model="demo",
        mode="split",
        batch_size=BATCH,
        loader_workers=1,
        verify_hashes=verify,
    )
    manifest = read_manifest(str(shards))
    return timed(
        train_loader(manifest, cfg.loader(), World(), epoch_plan(manifest, cfg, 1, epoch=0), epoch=0),
        num_images,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "imagenet-sample-100"
    )
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        num_images = build_tree(photos(args.images, root / "generated"), args.copies, root / "tree")
        convert(root / "tree", root / "shards", ConvertOptions(maxcount=100))
        size_mb = sum(s.num_bytes for s in read_manifest(str(root / "shards")).shards("train")) / 1e6
        rows: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for verify in (False, True):
                rows.setdefault(f"read only{', --verify-hashes' if verify else ''}", []).append(
                    read_rate(root / "shards", verify)
                )
            for verify in (False, True):
                rows.setdefault(f"loader 1w 224 px{', --verify-hashes' if verify else ''}", []).append(
                    loader_rate(root / "shards", verify, num_images)
                )
    print(f"{num_images} samples, {size_mb:.0f} MB of shards, medians of {args.rounds} rounds")
    print("| pipeline | samples/s | with hashes / without |")
    print("| --- | --- | --- |")
    medians = {name: statistics.median(values) for name, values in rows.items()}
    for name, rate in medians.items():
        base = medians.get(name.replace(", --verify-hashes", ""), rate)
        print(f"| {name} | {rate:.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
