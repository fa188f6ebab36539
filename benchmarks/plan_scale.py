"""How long a split plan takes as the data and the cluster grow: raywds's `deal` (a heap of
slot loads) against the scan it replaced (every slot looked at for every shard), on synthetic
manifests of ImageNet's size (1,282 shards of ~1,000) and LAION-400M's (400,000 shards of
~1,000), each rank with 8 loader workers. The two deals give the same plan (tests/plan/test_deal.py).

    .venv/bin/python benchmarks/plan_scale.py                 # the table in docs/performance.md
    .venv/bin/python benchmarks/plan_scale.py --quick         # a smoke run

The scan is run only where it takes under a minute or so; the table says which it skipped.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plan"))  # the scan, as the tests keep it

from test_deal import scanned

from raywds.data import manifest
from raywds.data.manifest import ShardInfo
from raywds.plan import epoch, split
from raywds.plan.split import Split

WORKERS = 8


def synthetic(count: int) -> list[ShardInfo]:
    rng = random.Random(count)
    return [ShardInfo(f"shard-{i:06d}.tar", rng.randint(950, 1050), 0, "") for i in range(count)]


def plan_seconds(shards: list[ShardInfo], ranks: int, dealer: Callable | None, repeats: int) -> float:
    """Median seconds of one rank's split plan: the deal to the ranks (every rank makes the same
    one), then its own shards to its workers (raywds.plan.epoch.WorkerShards)."""
    times = []
    for _ in range(repeats):
        with (
            mock.patch.object(split, "deal", dealer or manifest.deal),
            mock.patch.object(epoch, "deal", dealer or manifest.deal),
        ):
            started = time.perf_counter()
            plan = Split().plan(shards, num_ranks=ranks, num_workers=WORKERS, batch_size=256, seed=0, epoch=1)
            [plan.slot(ranks - 1, w) for w in range(WORKERS)]
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--scan-limit", type=float, default=3e8, help="skip the scan above shards x ranks")
    args = parser.parse_args()
    cases = [(1282, 8), (1282, 512), (1282, 4096), (400_000, 512), (400_000, 4096)]
    if args.quick:
        cases = [(1282, 8), (1282, 512), (20_000, 512)]
    print("| shards | ranks x workers | scan (before) | heap (raywds) | scan / heap |")
    print("| --- | --- | --- | --- | --- |")
    for count, ranks in cases:
        shards = synthetic(count)
        heap = plan_seconds(shards, ranks, None, 3)
        if count * ranks <= args.scan_limit:
            scan = plan_seconds(shards, ranks, scanned, 1)
            before, ratio = f"{scan:.3f} s", f"{scan / heap:.0f}x"
        else:
            before, ratio = "skipped", "–"
        print(f"| {count:,} | {ranks:,} x {WORKERS} | {before} | {heap:.3f} s | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
