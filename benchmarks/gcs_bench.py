"""gs:// shards: raywds's reader (the JSON API's media GET through raywds.data.http) against
pyarrow's `GcsFileSystem` (which Ray brings), on the same objects in a private GCS emulator.

    ./run-venv && .venv/bin/python benchmarks/gcs_bench.py [--images DIR] [--samples 2000] [--shards 16] [--rounds 5]

The 100 real ImageNet photos (../shared/data/imagenet-sample-100) repeated to `samples` JPEGs in
`shards` webdataset.ShardWriter shards, put into fake-gcs-server (tests/support/gcsserver.py: on
127.0.0.1, its own port and folder, stopped by its PID). Each row reads every shard whole on 16
threads, as `raywds index` and a loader's prefetch read them, in 1 MiB reads:

- raywds: `stores.open_shard("gs://…")`, one streaming GET a shard, resumed with a Range after a
  broken connection (counted retries, the loader's timeouts);
- pyarrow `open_input_stream`: its sequential reader;
- pyarrow `open_input_file`: its random-access file, read in order (what a reader that seeks uses).

Each row against raywds's, interleaved over `rounds` rounds (median and spread), with the CPU
seconds of this process and of the emulator in each pass (they share this machine's cores).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.fs as pafs
import webdataset as wds
from loader_bench import photos
from store_bench import store_cpu_s

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.gcsserver import gcs_server  # the tests' private GCS emulator, stopped by its PID
from support.runs import own_cpu_s  # this process's CPU seconds

from raywds.data import gcs, stores
from raywds.data.http import ReadPolicy

BUCKET = "raywds-bench"
THREADS = 16


def shards(images: list[Path], num_samples: int, num_shards: int) -> dict[str, bytes]:
    """ShardWriter shards of the photos, by object name."""
    per = -(-num_samples // num_shards)
    out: dict[str, bytes] = {}
    for s in range(num_shards):
        buffer = io.BytesIO()
        with wds.TarWriter(buffer) as sink:
            for i in range(s * per, min(num_samples, (s + 1) * per)):
                sink.write({"__key__": f"k{i:06d}", "jpg": images[i % len(images)].read_bytes(), "cls": b"0"})
        out[f"bench/x-{s:04d}.tar"] = buffer.getvalue()
    return out


def read_all(stream: object) -> int:
    n = 0
    while chunk := stream.read(1 << 20):  # type: ignore[attr-defined]
        n += len(chunk)
    return n


def raywds_read(url: str) -> int:
    with stores.open_shard(url, ReadPolicy()) as stream:
        return read_all(stream)


def pyarrow_reader(fs: pafs.GcsFileSystem, random_access: bool) -> Callable[[str], int]:
    def read(url: str) -> int:
        path = url[len(gcs.SCHEME) :]
        opened = fs.open_input_file(path) if random_access else fs.open_input_stream(path)
        with opened as stream:
            return read_all(stream)

    return read


def timed(read: Callable[[str], int], urls: list[str], server_pid: int) -> dict[str, float]:
    cpu, served, start = own_cpu_s(), store_cpu_s(server_pid), time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        total = sum(pool.map(read, urls))
    return {
        "s": time.perf_counter() - start,
        "bytes": total,
        "cpu": own_cpu_s() - cpu,
        "server_cpu": store_cpu_s(server_pid) - served,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    )
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        images = photos(args.images, Path(tmp) / "generated")
        kind = "real ImageNet" if args.images.is_dir() else "generated"
        objects = shards(images, args.samples, args.shards)
    num_bytes = sum(len(b) for b in objects.values())
    with tempfile.TemporaryDirectory() as tmp, gcs_server(tmp, buckets=(), preload={BUCKET: objects}) as server:
        host = server.endpoint.split("://", 1)[1]
        os.environ.update(server.env())
        fs = pafs.GcsFileSystem(anonymous=True, scheme="http", endpoint_override=host)
        urls = [server.url(BUCKET, name) for name in objects]
        rows: dict[str, Callable[[str], int]] = {
            "raywds (stores.open_shard)": raywds_read,
            "pyarrow open_input_stream": pyarrow_reader(fs, random_access=False),
            "pyarrow open_input_file": pyarrow_reader(fs, random_access=True),
        }
        for read in rows.values():  # connections and the emulator's first requests untimed
            assert sum(map(read, urls[:2])) == sum(len(objects[n]) for n in list(objects)[:2])
        results: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
        for r in range(args.rounds):
            for name in list(rows) if r % 2 == 0 else list(rows)[::-1]:
                result = timed(rows[name], urls, server.pid)
                assert result["bytes"] == num_bytes, (name, result["bytes"], num_bytes)
                results[name].append(result)
    base = statistics.median(r["s"] for r in results["raywds (stores.open_shard)"])
    print(
        f"{args.samples} JPEGs ({len(images)} {kind} photos) in {args.shards} ShardWriter shards, "
        f"{num_bytes / 1e6:.0f} MB, fake-gcs-server on 127.0.0.1; {THREADS} threads; median of {args.rounds} rounds\n"
    )
    print("| reader | MB/s (median) | rounds | ratio | CPU s per pass, client / emulator |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        s = statistics.median(r["s"] for r in runs)
        spread = (
            f"{min(num_bytes / r['s'] for r in runs) / 1e6:,.0f}–{max(num_bytes / r['s'] for r in runs) / 1e6:,.0f}"
        )
        cpu = statistics.median(r["cpu"] for r in runs)
        served = statistics.median(r["server_cpu"] for r in runs)
        print(f"| {name} | {num_bytes / s / 1e6:,.0f} | {spread} | {base / s:.2f}x | {cpu:.2f} / {served:.2f} |")


if __name__ == "__main__":
    main()
