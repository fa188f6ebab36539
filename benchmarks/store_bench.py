"""Shards from an S3-compatible store: raywds's reader against the usual clients, and the loader
from S3 against the loader from local disk.

    ./run-venv && .venv/bin/python benchmarks/store_bench.py [--images DIR] [--copies 20] [--rounds 3] [--skip-images N]

On `copies` x the photos in DIR (by default ../shared/data/imagenet-sample-100, real ImageNet
JPEGs; generated photo-like JPEGs without it) converted to NUM_SHARDS shards, put into a private
SeaweedFS (`weed mini`, started by tests/support/s3server.py on 127.0.0.1 with its own ports and keys, and
stopped at the end), in one run:

1. raw bytes/s, every shard read once whole, by: raywds's reader (`open_shard("s3://...")`: one
   streaming GET through boto3, read in 1 MiB reads); boto3's transfer manager
   (`download_fileobj` into memory, its default TransferConfig: above 8 MB, 8 MB ranged GETs on
   up to 10 threads); `pipe:curl` (`curl -s` of a presigned URL, SigV4, its stdout read by
   Python, one process per shard, as webdataset's `pipe:` runs it); pyarrow's `S3FileSystem`,
   `open_input_stream` read whole (which GETs 256 KiB ranges one after another) and
   `open_input_file` read whole (one GET). Each against boto3's transfer manager.
2. raywds's train loader (`--decode cpu`, 224 px, batch 64) with 1 and 2 DataLoader workers on
   `--data s3://bucket/prefix` and on the same shards on local disk, timed after the first batch
   as in loader_bench.py. Each S3 row against its local row. With --skip-images N, each loader
   is timed only after its first N images: a worker's shuffle buffer (1,000 samples) reads two
   samples for each one it yields until it is full, so a short pass reads about twice the bytes
   it decodes, and an epoch of thousands of samples a worker does not.

Beside each row, the CPU seconds of one pass: the client's (this process's threads, curl, the
loader's workers from their start) and the store's (the `weed` process); and the MB the store
sent in it (its `wchar` in /proc: what it wrote to sockets). The store runs on the
same cores as the clients and the loader workers, so what it spends is taken from them: a remote
store's would not be. Every byte count is checked against the manifest. This machine is shared
and noisy, so the rows are interleaved over `rounds` rounds and the median is reported with the
spread; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from loader_bench import BATCH, build_tree, photos, timed

from raywds.data.convert import ConvertOptions, convert
from raywds.data.http import ReadPolicy
from raywds.data.manifest import Manifest, read_manifest
from raywds.data.stores import open_shard
from raywds.data.upload import upload
from raywds.loader.loader import train_loader
from raywds.plan.modes import epoch_plan
from raywds.train.config import TrainConfig
from raywds.world import World

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import s3server  # the tests' private SeaweedFS: own temp dir, ports and keys; stopped by its PID
from support.runs import own_cpu_s  # this process's and its reaped children's CPU seconds

NUM_SHARDS = 16
PREFIX = "bench"
READ_BYTES = 1 << 20
Shard = tuple[str, int]
"""(key in the bucket, size in bytes)"""


def drain(stream: Any, key: str, size: int) -> int:
    """Read `stream` to its end in READ_BYTES reads; its length, checked against the manifest's."""
    total = 0
    while chunk := stream.read(READ_BYTES):
        total += len(chunk)
    if total != size:
        raise RuntimeError(f"{key}: read {total} bytes, the manifest says {size}")
    return total


def bytes_rate(shards: list[Shard], read: Callable[[str, int], int]) -> float:
    """MB/s (10^6 bytes) reading every shard once whole."""
    start = time.perf_counter()
    total = sum(read(key, size) for key, size in shards)
    return total / (time.perf_counter() - start) / 1e6


def read_raywds(bucket: str, key: str, size: int) -> int:
    with open_shard(f"s3://{bucket}/{key}", ReadPolicy(), size=size) as stream:
        return drain(stream, key, size)


def read_boto3(client: Any, bucket: str, key: str, size: int) -> int:
    out = io.BytesIO()
    client.download_fileobj(bucket, key, out)
    return drain(io.BytesIO(out.getbuffer()), key, size)


def read_curl(client: Any, bucket: str, key: str, size: int) -> int:
    url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600)
    with subprocess.Popen(["curl", "-s", "-f", url], stdout=subprocess.PIPE) as curl:
        assert curl.stdout is not None
        total = drain(curl.stdout, key, size)
    if curl.returncode:
        raise RuntimeError(f"{key}: curl exited with {curl.returncode}")
    return total


def read_pyarrow(fs: Any, bucket: str, key: str, size: int) -> int:
    """open_input_stream's read() of the whole object: GETs of 256 KiB ranges, one after another."""
    with fs.open_input_stream(f"{bucket}/{key}") as stream:
        data = stream.read()
    return drain(io.BytesIO(data), key, size)


def read_pyarrow_file(fs: Any, bucket: str, key: str, size: int) -> int:
    """open_input_file's read() of the whole object: one GET of the whole range."""
    with fs.open_input_file(f"{bucket}/{key}") as file:
        data = file.read()
    return drain(io.BytesIO(data), key, size)


def loader_rate(data: str, workers: int, num_images: int, skip: int = 0, manifest: Manifest | None = None) -> float:
    """raywds's train loader as loader_bench.py times it, on local shards or an s3:// prefix (or
    the shards `manifest` lists); with `skip`, timed only after the first `skip` images (once the
    shuffle buffers are full)."""
    cfg = TrainConfig(
        data=data,
        model="demo",
        batch_size=BATCH,
        loader_workers=workers,
        image_size=224,
        decode="cpu",
    )
    manifest = manifest or read_manifest(data)
    batches = iter(train_loader(manifest, cfg.loader(), World(), epoch_plan(manifest, cfg, 1, epoch=0), epoch=0))
    skipped = 0
    while skipped < skip:
        skipped += len(next(batches)[0])
    return timed(batches, num_images - skipped)


def weed_version() -> str:
    out = subprocess.run([str(s3server.weed_binary()), "version"], capture_output=True, text=True, check=False)
    found = re.search(r"\b\d+\.\d+\b", out.stdout)
    return f"SeaweedFS {found.group() if found else '(version unknown)'}"


def store_pid() -> int:
    """The `weed` process that s3server started from here, to read its CPU time."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, rest = stat.read_text().split(" (", 1)[1].rsplit(") ", 1)
        except (OSError, ValueError):  # gone meanwhile
            continue
        if comm == "weed" and int(rest.split()[1]) == os.getpid():
            return int(stat.parent.name)
    raise RuntimeError(f"no `weed` child of this process ({os.getpid()}) in /proc")


def store_sent_mb(pid: int) -> float:
    """MB process `pid` has written (`wchar`: sockets included), as the store's bytes sent."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1]) / 1e6
    raise RuntimeError(f"no wchar in /proc/{pid}/io")


def store_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_table(
    rows: dict[str, str],
    rate: dict[str, float],
    samples: dict[str, list[float]],
    cpu: dict[str, list[float]],
    unit: str,
) -> None:
    """A markdown table: each row's median, its spread over the rounds, its ratio to the row it is
    against (`rows`: name -> that row), the median CPU seconds of a pass (client, store) and the
    MB the store sent in it."""
    print(f"| row | {unit} (median) | rounds | ratio | CPU s per pass, client / store | MB sent by the store |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, base in rows.items():
        spread = f"{min(samples[name]):,.0f}–{max(samples[name]):,.0f}"
        client, store, sent = (statistics.median(cpu[f"{name} {who}"]) for who in ("client", "store", "sent"))
        print(
            f"| {name} | {rate[name]:,.0f} | {spread} | {rate[name] / rate[base]:.2f}x "
            f"| {client:.2f} / {store:.2f} | {sent:,.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    )
    parser.add_argument("--copies", type=int, default=20, help="copies of each photo (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--skip-images",
        type=int,
        default=0,
        help="time each loader only after this many images: past the shuffle buffers' filling, "
        "which reads two samples for each one it yields (default %(default)s: the whole pass)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, s3server.s3_server("raywds-bench") as server:
        # Before any client or loader worker exists: raywds and its forked workers find the store here.
        for name in s3server.FOREIGN_AWS_VARS:
            os.environ.pop(name, None)
        os.environ.update(server.env())
        root = Path(tmp)
        images = photos(args.images, root / "generated")
        n = build_tree(images, args.copies, root / "tree")
        options = ConvertOptions(maxcount=math.ceil(n / NUM_SHARDS), workers=cores)
        manifest = convert(root / "tree", root / "shards", options)
        url = server.url(PREFIX)
        upload(root / "shards", manifest, url)  # reads every shard back once: the store's cache is warm
        shards = [(f"{PREFIX}/{s['name']}", s["num_bytes"]) for s in manifest["splits"]["train"]["shards"]]
        skip = min(args.skip_images, n // 2)
        num_bytes = sum(size for _, size in shards)

        import pyarrow.fs

        fs = pyarrow.fs.S3FileSystem(
            endpoint_override=server.endpoint.removeprefix("http://"),
            access_key=server.access_key,
            secret_key=server.secret_key,
            region=server.region,
            scheme="http",
        )
        bucket = server.bucket
        readers = {
            "raywds open_shard, 1 MiB reads": partial(read_raywds, bucket),
            "boto3 download_fileobj": partial(read_boto3, server.client(), bucket),
            "pipe:curl, presigned URL": partial(read_curl, server.client(signature_version="s3v4"), bucket),
            "pyarrow S3FileSystem open_input_stream": partial(read_pyarrow, fs, bucket),
            "pyarrow S3FileSystem open_input_file": partial(read_pyarrow_file, fs, bucket),
        }
        runs: dict[str, Callable[[], float]] = {
            name: partial(bytes_rate, shards, read) for name, read in readers.items()
        }
        for workers in (1, 2):
            runs[f"loader, local disk, {workers}w"] = partial(loader_rate, str(root / "shards"), workers, n, skip)
            runs[f"loader, S3, {workers}w"] = partial(loader_rate, url, workers, n, skip)
        for read in readers.values():  # each client's first request (connections, pyarrow's S3 start) untimed
            read(*shards[0])

        kind = "generated" if images[0].is_relative_to(root) else "real ImageNet"
        print(
            f"{n} JPEGs ({len(images)} {kind} photos x {args.copies}) in {len(shards)} shards, "
            f"{num_bytes / 1e6:.0f} MB, on {weed_version()} at {server.endpoint} (same machine), batch {BATCH}, "
            f"{cores} cores, median of {args.rounds} rounds"
            + (f"; loaders timed after their first {skip} images" if skip else "")
        )
        store = store_pid()
        samples: dict[str, list[float]] = defaultdict(list)
        cpu: dict[str, list[float]] = defaultdict(list)
        for _ in range(args.rounds):
            for name, run in runs.items():
                own, served, sent = own_cpu_s(), store_cpu_s(store), store_sent_mb(store)
                samples[name].append(run())
                cpu[name + " client"].append(own_cpu_s() - own)  # a loader's workers are reaped by now
                cpu[name + " store"].append(store_cpu_s(store) - served)
                cpu[name + " sent"].append(store_sent_mb(store) - sent)
    rate = {name: statistics.median(values) for name, values in samples.items()}
    boto3_row = "boto3 download_fileobj"
    print()
    print_table({name: boto3_row for name in readers}, rate, samples, cpu, "MB/s")
    print()
    loaders = {name: name.replace("S3", "local disk") for name in runs if name.startswith("loader")}
    print_table(loaders, rate, samples, cpu, "images/s")
    print()
    ours = rate["raywds open_shard, 1 MiB reads"] / rate[boto3_row]
    print(
        f"raywds's reader / boto3's transfer manager: {ours:.2f}x (goal >= 1.0x: {'met' if ours >= 1.0 else 'not met'})"
    )
    for workers in (1, 2):
        ratio = rate[f"loader, S3, {workers}w"] / rate[f"loader, local disk, {workers}w"]
        print(
            f"loader from S3 / from local disk, {workers} worker{'s' * (workers > 1)}: {ratio:.2f}x "
            f"(goal >= 0.95x: {'met' if ratio >= 0.95 else 'not met'})"
        )
    print(
        f"wall time {time.perf_counter() - started:.0f} s (the store's start and stop, conversion and upload included)"
    )


if __name__ == "__main__":
    main()
