"""Loading a manifest as the data grows: `manifest.json` against its columns (`manifest.npz`,
raywds.data.columns), on synthetic manifests of ImageNet's size (1,282 shards) and LAION-400M's
(400,000 shards of ~1,000 samples) and a quarter of that (the size tests/data/test_columns.py
counts the work of), as `raywds convert` writes them (names, counts, sizes and sha256 of each shard).

For each: the files' sizes; `read_manifest` in seconds (median of 3, numpy already imported, as
it is in every rank), and how many times faster the columns load than the JSON; its memory
(tracemalloc: held after, and the peak); and making every shard's record once
(`list(manifest.shards("train"))`, what a split plan does).

    .venv/bin/python benchmarks/manifest_bench.py            # the table in docs/performance.md
    .venv/bin/python benchmarks/manifest_bench.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy  # noqa: F401 - loaded in every rank before a manifest is read

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raywds.data.columns import COLUMNS
from raywds.data.manifest import FORMAT, MANIFEST, read_manifest, write_manifest


def synthetic(folder: Path, count: int) -> None:
    shards: list[dict[str, Any]] = [
        {
            "name": f"laion-train-{i:06d}.tar",
            "num_samples": 950 + (i * 7919) % 101,
            "num_bytes": 110_000 * 1000 + i,
            "sha256": hashlib.sha256(i.to_bytes(4, "little")).hexdigest(),
        }
        for i in range(count)
    ]
    total = sum(s["num_samples"] for s in shards)
    classes = [f"n{i:08d}" for i in range(1000)]
    write_manifest(
        folder, {"format": FORMAT, "classes": classes, "splits": {"train": {"num_samples": total, "shards": shards}}}
    )


def measure(folder: Path, use_columns: bool) -> dict[str, float]:
    times = []
    for _ in range(3):
        gc.collect()
        start = time.perf_counter()
        read_manifest(str(folder), use_columns=use_columns)
        times.append(time.perf_counter() - start)
    gc.collect()
    tracemalloc.start()
    manifest = read_manifest(str(folder), use_columns=use_columns)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    start = time.perf_counter()
    records = list(manifest.shards("train"))
    listed = time.perf_counter() - start
    del records, manifest
    return {"load_s": statistics.median(times), "held": held, "peak": peak, "list_s": listed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    args = parser.parse_args()
    print("| shards | read from | file | load | x the JSON's speed | held / peak memory | every shard's record once |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for count in [1282, 20_000] if args.quick else [1282, 100_000, 400_000]:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            synthetic(folder, count)
            json_s = 0.0
            for use_columns, name in ((False, MANIFEST), (True, COLUMNS)):
                m = measure(folder, use_columns)
                json_s = json_s or m["load_s"]
                faster = f"{json_s / m['load_s']:.0f}x" if use_columns else "—"
                size = (folder / name).stat().st_size / 1e6
                print(
                    f"| {count:,} | `{name}` | {size:.2f} MB | {m['load_s']:.3f} s | {faster} "
                    f"| {m['held'] / 1e6:.1f} / {m['peak'] / 1e6:.1f} MB | {m['list_s']:.3f} s |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
