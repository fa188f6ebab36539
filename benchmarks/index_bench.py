"""`raywds index` on WebDataset shards raywds did not write: against reading every byte of the same
shards, from a folder, over HTTP and from S3; and the training loader on them against the same
photos in raywds's own shards.

    ./run-venv && .venv/bin/python benchmarks/index_bench.py [--images DIR] [--samples 2000] [--shards 16] [--rounds 3]

On `samples` copies of the photos in DIR (by default ../shared/data/imagenet-sample-100, real
ImageNet JPEGs; generated photo-like JPEGs without it), written as an ImageFolder tree
(train/<class>/*.JPEG, and one copy of each photo in val/) and converted with
`raywds convert --keep-jpeg-bytes` into NUM shards; then the same samples, in the same order and
the same shard cuts, written again by `webdataset.ShardWriter` as `foreign-NNNNNN.tar` with only
`.jpg` and `.cls` members (the JPEG bytes checked equal to the photos'): shards as anyone writes
them. In one run, each row against the row under it in its table, over `rounds` interleaved rounds:

1. from a local folder: `index_shards` (a thread a shard, as `raywds index` runs; each shard walked
   from header to header with tarfile over an unbuffered file) against a plain read of every
   byte of the same shards through `raywds.data.stores.open_shard` in 1 MiB reads on as many
   threads. Warm (the shards in the page cache), and cold (after `echo 1 >
   /proc/sys/vm/drop_caches`, where this process may write it; the rows are left out otherwise).
   Bytes read by Python (the index's `made_by.bytes_read`) and from the disk (this process's
   `read_bytes` in /proc/self/io: what the kernel fetched, read-ahead included).
2. over HTTP: http.server (`python -m http.server`'s ThreadingHTTPServer and handler, with a
   listen backlog of 128: its default of 5 drops some of 16 simultaneous connections' SYNs, and
   their 1 s retry decided each row) on 127.0.0.1 serving the folder (a free port; stopped by its
   PID), the brace URL indexed (each shard streamed and hashed) against the plain read.
3. from S3: a private SeaweedFS (`weed mini`, tests/support/s3server.py, as store_bench.py starts
   it), the shards put under a prefix, the s3:// prefix indexed against the plain read.
4. raywds's train loader (`--decode cpu`, 224 px, batch 64, WORKERS workers, timed after the first
   batch as in loader_bench.py) on the foreign shards through
   `manifest_for(brace URL, index_cache=...)`, against the converted shards, alternated; and on
   the same foreign shards written with plain ustar headers (`ShardWriter(..., mtime=<int>)`):
   webdataset's TarWriter stamps members with a float mtime in tarfile's pax format, so a pax
   header comes before every member, and that row tells what those headers cost the loader.

Each table gives the medians, the spread over the rounds and the CPU seconds of a pass (this
process's threads and its reaped loader workers; the server's process). The servers run on the
same cores as the clients. The tables are printed and written, with the machine and the
command, to benchmarks/results/index_bench-DATE.md and .json (a rerun on the same day replaces them).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
import webdataset as wds
from loader_bench import BATCH, photos
from store_bench import loader_rate as store_loader_rate
from store_bench import store_cpu_s, store_pid, weed_version

from raywds.data import shardlists, stores
from raywds.data.convert import ConvertOptions, convert
from raywds.data.dataset import manifest_for
from raywds.data.http import ReadPolicy
from raywds.data.index import index_shards
from raywds.data.manifest import Manifest, read_manifest
from raywds.data.shardoptions import IndexOptions
from raywds.data.stores import Storage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import s3server  # the tests' private SeaweedFS: own temp dir, ports and keys; stopped by its PID
from support.runs import own_cpu_s  # this process's and its reaped children's CPU seconds

HOST = "127.0.0.1"
READ_BYTES = 1 << 20
FOREIGN = "foreign-%06d.tar"
PREFIX = "foreign"
RESULTS = Path(__file__).resolve().parent / "results"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
USTAR_ROW = "the same foreign shards, ustar headers (no pax header a member)"


def build_tree(images: list[Path], num_samples: int, root: Path) -> None:
    """`num_samples` copies of the photos as train/<class>/<photo>_<copy>.JPEG (names distinct),
    and each photo once as val/<class>/<photo>.JPEG."""
    for i in range(num_samples):
        path = images[i % len(images)]
        folder = root / "train" / path.name.split("_")[0]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{path.stem}_{i // len(images):04d}.JPEG").write_bytes(path.read_bytes())
    for path in images:
        folder = root / "val" / path.name.split("_")[0]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / path.name).write_bytes(path.read_bytes())


def write_foreign(
    own: Path, manifest: dict[str, Any], images: list[Path], out: Path, whole_second_mtime: bool = False
) -> list[Path]:
    """The converted train shards' samples again, in their order and shard cuts, as webdataset's
    ShardWriter writes them: `.jpg` and `.cls` only. Each JPEG is checked to be one of the photos
    byte for byte (--keep-jpeg-bytes), so both kinds of shard hold the same decode work. webdataset's
    TarWriter stamps each member with time.time(), a float, in tarfile's default pax format (its own
    `format=` goes unused in webdataset 1.0.2), so each member comes after a pax header holding that
    mtime; `whole_second_mtime` gives it an integer mtime, and the tar plain ustar headers."""
    formats = {"mtime": int(time.time())} if whole_second_mtime else {}
    photo_hashes = {hashlib.sha256(p.read_bytes()).digest() for p in images}
    entries = manifest["splits"]["train"]["shards"]
    out.mkdir(parents=True)
    with wds.ShardWriter(
        str(out / FOREIGN), maxcount=max(e["num_samples"] for e in entries), verbose=0, **formats
    ) as writer:
        for i, entry in enumerate(entries):
            if i and writer.count:
                writer.next_stream()  # convert's cut, whatever the counts
            with tarfile.open(own / entry["name"]) as tar:
                samples: dict[str, dict[str, Any]] = {}
                for info in tar:
                    key, ext = info.name.split(".", 1)
                    member = tar.extractfile(info)
                    assert member is not None
                    samples.setdefault(key, {"__key__": key})[ext] = member.read()
            for sample in samples.values():
                if hashlib.sha256(sample["jpg"]).digest() not in photo_hashes:
                    raise RuntimeError(f"{entry['name']}: {sample['__key__']}.jpg is not one of the photos' bytes")
                writer.write({"__key__": sample["__key__"], "jpg": sample["jpg"], "cls": int(sample["cls"])})
    return sorted(out.glob("foreign-*.tar"))


def drop_page_cache() -> bool:
    """Write back and drop the clean page cache; False where this process may not."""
    os.sync()
    try:
        DROP_CACHES.write_text("1\n")
    except OSError:
        return False
    return True


def disk_read_bytes() -> int:
    """Bytes this process had the kernel fetch from storage (read-ahead included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def read_whole(url: str, policy: ReadPolicy) -> int:
    total = 0
    with stores.open_shard(url, policy) as stream:
        while chunk := stream.read(READ_BYTES):
            total += len(chunk)
    return total


def plain_read(urls: list[str], policy: ReadPolicy, num_threads: int, num_bytes: int) -> dict[str, float]:
    """Every byte of every shard through open_shard, `num_threads` shards at once: seconds, bytes."""
    start = time.perf_counter()
    with ThreadPoolExecutor(num_threads) as pool:
        total = sum(pool.map(partial(read_whole, policy=policy), urls))
    seconds = time.perf_counter() - start
    if total != num_bytes:
        raise RuntimeError(f"read {total} bytes of {len(urls)} shards, which hold {num_bytes}")
    return {"s": seconds, "read": total}


def indexed(
    urls: list[str], policy: ReadPolicy, num_threads: int, num_samples: int, skip_hash: bool = False
) -> dict[str, float]:
    """`index_shards` on the shards: seconds (around the call), bytes it read, its own seconds."""
    start = time.perf_counter()
    options = IndexOptions(workers=num_threads, skip_hash=skip_hash)
    manifest = index_shards({"train": urls}, options, policy=policy)
    seconds = time.perf_counter() - start
    found = manifest["splits"]["train"]["num_samples"]
    if found != num_samples or manifest["skipped"] or manifest["bad_shards"]:
        raise RuntimeError(f"the index found {found} samples of {num_samples}: {manifest['skipped'][:3]}")
    made_by = manifest["made_by"]
    return {"s": seconds, "read": made_by["bytes_read"], "own_s": made_by["seconds"]}


def free_port() -> int:
    return s3server.free_ports(1)[0]


def process_cpu_s(pid: int) -> float:
    return store_cpu_s(pid)


SERVE = """
import functools, http.server, sys, time
class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 128  # socketserver's 5 drops SYNs of 16 connections at once: a 1 s retry
class Paced(http.server.SimpleHTTPRequestHandler):
    rate = float(sys.argv[4])  # bytes/s a connection, 0: as fast as it goes
    def copyfile(self, source, outputfile):
        if not self.rate:
            return super().copyfile(source, outputfile)
        start, sent = time.monotonic(), 0
        while chunk := source.read(1 << 16):
            outputfile.write(chunk)
            sent += len(chunk)
            time.sleep(max(0.0, start + sent / self.rate - time.monotonic()))
handler = functools.partial(Paced, directory=sys.argv[1])
Server((sys.argv[2], int(sys.argv[3])), handler).serve_forever()
"""
"""`python -m http.server`'s server and handler, with a listen backlog of 128 in place of 5, and
(with a rate) each response paced to that many bytes/s, as a link or an object store's
per-request stream would deliver it."""


@contextlib.contextmanager
def http_server(folder: Path, log: Path, rate: float = 0.0) -> Iterator[tuple[str, int]]:
    """http.server serving `folder` on 127.0.0.1 (SERVE): (its URL, its PID); stopped by that PID."""
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(folder), HOST, str(port), str(rate)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/", timeout=2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"http.server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def loader_rate(manifest: Manifest, data: str, workers: int, num_images: int) -> float:
    """raywds's train loader over `manifest`'s shards, as store_bench.py times it."""
    return store_loader_rate(data, workers, num_images, manifest=manifest)


def paired(rounds: Rounds, name: str, base: str) -> float:
    """The median over rounds of a row's rate against its baseline's in the same round: on a
    machine whose speed drifts by 20% within a minute, the medians of each row alone are not."""
    return statistics.median(a["rate"] / b["rate"] for a, b in zip(rounds.rows[name], rounds.rows[base]))


def as_row(run: Callable[[], float]) -> dict[str, float]:
    return {"rate": run()}


class Rounds:
    """Measurements by row over interleaved rounds: each a dict of numbers, plus CPU seconds."""

    def __init__(self) -> None:
        self.rows: dict[str, list[dict[str, float]]] = defaultdict(list)

    def measure(self, name: str, run: Callable[[], dict[str, float]], server: int | None = None) -> None:
        cpu, served, disk = own_cpu_s(), process_cpu_s(server) if server else 0.0, disk_read_bytes()
        result = run()
        result["cpu"] = own_cpu_s() - cpu  # a loader's workers are reaped by now
        result["server_cpu"] = process_cpu_s(server) - served if server else 0.0
        result["disk"] = disk_read_bytes() - disk
        self.rows[name].append(result)

    def median(self, name: str, key: str) -> float:
        return statistics.median(r[key] for r in self.rows[name])

    def spread(self, name: str, key: str, scale: Callable[[float], float] = lambda x: x) -> str:
        values = [scale(r[key]) for r in self.rows[name]]
        return f"{min(values):,.0f}–{max(values):,.0f}"


def mb(num_bytes: float) -> str:
    return f"{num_bytes / 1e6:,.0f}"


def local_table(rounds: Rounds, pairs: list[tuple[str, str]], num_bytes: int) -> list[str]:
    """Seconds and MB/s (of the shards' bytes) of each row, and its speed against its plain read."""
    lines = [
        "| row | seconds (median) | MB/s of shards | rounds, MB/s | ratio | MB read by Python | "
        "MB from disk | CPU s per pass |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, base in pairs:
        s, rates = rounds.median(name, "s"), rounds.spread(name, "s", lambda x: num_bytes / x / 1e6)
        lines.append(
            f"| {name} | {s:.3f} | {num_bytes / s / 1e6:,.0f} | {rates} "
            f"| {rounds.median(base, 's') / s:.2f}x | {mb(rounds.median(name, 'read'))} "
            f"({rounds.median(name, 'read') / num_bytes:.1%}) | {mb(rounds.median(name, 'disk'))} "
            f"| {rounds.median(name, 'cpu'):.2f} |"
        )
    return lines


def remote_table(rounds: Rounds, pairs: list[tuple[str, str]], num_bytes: int, server: str) -> list[str]:
    lines = [
        f"| row | MB/s (median) | rounds | ratio | MB read | CPU s per pass, client / {server} |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, base in pairs:
        s = rounds.median(name, "s")
        lines.append(
            f"| {name} | {num_bytes / s / 1e6:,.0f} | {rounds.spread(name, 's', lambda x: num_bytes / x / 1e6)} "
            f"| {rounds.median(base, 's') / s:.2f}x | {mb(rounds.median(name, 'read'))} "
            f"| {rounds.median(name, 'cpu'):.2f} / {rounds.median(name, 'server_cpu'):.2f} |"
        )
    return lines


def loader_table(rounds: Rounds, pairs: list[tuple[str, str]]) -> list[str]:
    lines = [
        "| row | images/s (median) | rounds | ratio (median of the rounds' ratios) | CPU s per pass |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, base in pairs:
        rate = rounds.median(name, "rate")
        lines.append(
            f"| {name} | {rate:,.0f} | {rounds.spread(name, 'rate')} | {paired(rounds, name, base):.2f}x "
            f"| {rounds.median(name, 'cpu'):.2f} |"
        )
    return lines


def goal(line: str, ratio: float, target: float) -> str:
    return f"{line}: {ratio:.2f}x (goal >= {target}x: {'met' if ratio >= target else 'not met'})"


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    cores = len(os.sched_getaffinity(0))
    return f"{cores} cores ({cpu}), Python {platform.python_version()}, webdataset {wds.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    )
    parser.add_argument("--samples", type=int, default=2000, help="train samples (default %(default)s)")
    parser.add_argument("--shards", type=int, default=16, help="train shards (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loader-rounds", type=int, default=9, help="rounds of the loader rows (default 9)")
    parser.add_argument("--link-mb-s", type=float, default=16.0, help="the paced server's MB/s a connection")
    parser.add_argument("--workers", type=int, help="loader workers (default: one a core)")
    parser.add_argument("--no-results", action="store_true", help="print only; write nothing to benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0))
    workers = args.workers or cores
    started = time.perf_counter()
    out: list[str] = []
    record: dict[str, Any] = {}

    def show(*lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            out.append(line)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        images = photos(args.images, root / "generated")
        kind = "generated" if images[0].is_relative_to(root) else "real ImageNet"
        build_tree(images, args.samples, root / "tree")
        options = ConvertOptions(maxcount=math.ceil(args.samples / args.shards), workers=cores, keep_jpeg_bytes=True)
        own = convert(root / "tree", root / "own", options)
        paths = write_foreign(root / "own", own, images, root / "foreign")
        ustar = root / "foreign-ustar"  # the same, without a pax header before each member
        write_foreign(root / "own", own, images, ustar, whole_second_mtime=True)
        urls = [str(p) for p in paths]
        num_bytes = sum(p.stat().st_size for p in paths)
        threads = max(1, min(IndexOptions().workers, len(urls)))
        brace = f"{{{0:06d}..{len(urls) - 1:06d}}}"
        show(
            f"{args.samples} JPEGs ({len(images)} {kind} photos, repeated) in {len(urls)} foreign shards "
            f"(webdataset.ShardWriter, .jpg and .cls), {num_bytes / 1e6:.0f} MB; {threads} threads for index and "
            f"plain read alike; median of {args.rounds} rounds; {machine()}"
        )
        local = Rounds()
        policy = ReadPolicy()
        plain = partial(plain_read, urls, policy, threads, num_bytes)
        index = partial(indexed, urls, policy, threads, args.samples)
        plain()  # the page cache warm for the first round
        cold = drop_page_cache()
        pairs = [("plain read, warm", "plain read, warm"), ("index, warm", "plain read, warm")]
        if cold:
            pairs += [("plain read, cold", "plain read, cold"), ("index, cold", "plain read, cold")]
        for _ in range(args.rounds):
            local.measure("plain read, warm", plain)
            local.measure("index, warm", index)
            if cold:
                drop_page_cache()
                local.measure("plain read, cold", plain)
                drop_page_cache()
                local.measure("index, cold", index)
                plain()  # warm again for the next round's warm rows
        show(
            "",
            "1. From a local folder"
            + (
                " (cold: page cache dropped before the row)"
                if cold
                else " (the page cache could not be dropped: every row warm)"
            ),
            "",
            *local_table(local, pairs, num_bytes),
        )
        record["local"] = dict(local.rows)

        with http_server(root / "foreign", root / "http.log") as (base, pid):
            http_urls = shardlists.expand([f"{base}/foreign-{brace}.tar"])
            remote = Rounds()
            plain = partial(plain_read, http_urls, policy, threads, num_bytes)
            index = partial(indexed, http_urls, policy, threads, args.samples)
            unhashed = partial(indexed, http_urls, policy, threads, args.samples, skip_hash=True)
            plain()  # connections and the server's first requests untimed
            for _ in range(args.rounds):
                remote.measure("plain read", plain, pid)
                remote.measure("index", index, pid)
                remote.measure("index --skip-hash", unhashed, pid)
        http_pairs = [("plain read", "plain read"), ("index", "plain read"), ("index --skip-hash", "plain read")]
        show("", "2. Over HTTP (http.server, listen backlog 128, on 127.0.0.1, same machine)", "")
        show(*remote_table(remote, http_pairs, num_bytes, "server"))
        http_ratio = remote.median("plain read", "s") / remote.median("index", "s")
        http_unhashed = remote.median("plain read", "s") / remote.median("index --skip-hash", "s")
        record["http"] = dict(remote.rows)

        # The same over a link: each response paced to --link-mb-s, as an object store streams one GET
        link = args.link_mb_s * 1e6
        with http_server(root / "foreign", root / "http-paced.log", rate=link) as (base, pid):
            paced_urls = shardlists.expand([f"{base}/foreign-{brace}.tar"])
            paced = Rounds()
            plain = partial(plain_read, paced_urls, policy, threads, num_bytes)
            index = partial(indexed, paced_urls, policy, threads, args.samples)
            plain()
            for _ in range(args.rounds):
                paced.measure("plain read", plain, pid)
                paced.measure("index", index, pid)
        show(
            "",
            f"2b. Over HTTP at {args.link_mb_s:g} MB/s a connection ({threads} at once: "
            f"{threads * args.link_mb_s:g} MB/s at most), the pace of a link or an object store's GET",
            "",
        )
        show(*remote_table(paced, http_pairs[:2], num_bytes, "server"))
        paced_ratio = paced.median("plain read", "s") / paced.median("index", "s")
        record["http_paced"] = dict(paced.rows)

        with s3server.s3_server("raywds-bench") as server:
            for name in s3server.FOREIGN_AWS_VARS:
                os.environ.pop(name, None)
            os.environ.update(server.env())
            client = server.client()
            for path in paths:
                client.upload_file(str(path), server.bucket, f"{PREFIX}/{path.name}")
            s3_policy = ReadPolicy(s3_endpoint=server.endpoint)
            s3_urls = shardlists.expand([server.url(f"{PREFIX}/")], Storage(server.endpoint))
            assert len(s3_urls) == len(urls), s3_urls
            store = Rounds()
            plain = partial(plain_read, s3_urls, s3_policy, threads, num_bytes)
            index = partial(indexed, s3_urls, s3_policy, threads, args.samples)
            unhashed = partial(indexed, s3_urls, s3_policy, threads, args.samples, skip_hash=True)
            plain()  # the client's first requests and the store's cache untimed
            weed = store_pid()
            for _ in range(args.rounds):
                store.measure("plain read", plain, weed)
                store.measure("index", index, weed)
                store.measure("index --skip-hash", unhashed, weed)
            version = weed_version()
        show("", f"3. From S3 ({version}, `weed mini` on 127.0.0.1, same machine)", "")
        show(*remote_table(store, http_pairs, num_bytes, "store"))
        s3_ratio = store.median("plain read", "s") / store.median("index", "s")
        s3_unhashed = store.median("plain read", "s") / store.median("index --skip-hash", "s")
        record["s3"] = dict(store.rows)

        started_index = time.perf_counter()
        foreign = manifest_for(str(root / "foreign" / f"foreign-{brace}.tar"), index_cache=str(root / "cache"))
        index_s = time.perf_counter() - started_index
        ours = read_manifest(str(root / "own"))
        ustar_data = str(ustar / f"foreign-{brace}.tar")
        plain_headers = manifest_for(ustar_data, index_cache=str(root / "cache"))
        rows = {
            "raywds's own shards (convert --keep-jpeg-bytes)": partial(
                loader_rate, ours, str(root / "own"), workers, args.samples
            ),
            "foreign shards (webdataset.ShardWriter), through manifest_for": partial(
                loader_rate, foreign, str(root / "foreign" / f"foreign-{brace}.tar"), workers, args.samples
            ),
            USTAR_ROW: partial(loader_rate, plain_headers, ustar_data, workers, args.samples),
        }
        loaders = Rounds()
        for r in range(args.loader_rounds):  # ABC, CBA, ...: neither order nor drift favours a row
            for name in list(rows) if r % 2 == 0 else list(rows)[::-1]:
                loaders.measure(name, partial(as_row, rows[name]))
    own_name, foreign_name, _ = rows
    show(
        "",
        f"4. The train loader, --decode cpu, 224 px, batch {BATCH}, {workers} workers, {args.samples} images a pass, "
        f"alternated (the foreign index made once by manifest_for in {index_s:.2f} s)",
        "",
        *loader_table(loaders, [(own_name, own_name), (foreign_name, own_name), (USTAR_ROW, own_name)]),
    )
    record["loader"] = dict(loaders.rows)
    loader_ratio = paired(loaders, foreign_name, own_name)
    ustar_ratio = paired(loaders, USTAR_ROW, own_name)
    local_ratio = local.median("plain read, warm", "s") / local.median("index, warm", "s")
    show(
        "",
        f"local, warm: the index reads {local.median('index, warm', 'read') / num_bytes:.1%} of the bytes, "
        f"{local_ratio:.1f}x as fast as reading them all",
        goal("over HTTP, index / plain read", http_ratio, 0.9),
        goal("over HTTP, index --skip-hash / plain read", http_unhashed, 0.9),
        goal(f"over HTTP at {args.link_mb_s:g} MB/s a connection, index / plain read", paced_ratio, 0.9),
        goal("from S3, index / plain read", s3_ratio, 0.9),
        goal("from S3, index --skip-hash / plain read", s3_unhashed, 0.9),
        goal("loader, foreign / raywds's own shards", loader_ratio, 0.97),
        f"loader, the same foreign shards with ustar headers / raywds's own shards: {ustar_ratio:.2f}x",
        f"wall time {time.perf_counter() - started:.0f} s (conversion, servers' start and stop included)",
    )
    if args.no_results:
        return
    today = datetime.date.today().isoformat()
    command = "python benchmarks/index_bench.py " + " ".join(sys.argv[1:])
    RESULTS.mkdir(exist_ok=True)
    header = [f"# index_bench, {today}", "", "```bash", command.strip(), "```", ""]
    (RESULTS / f"index_bench-{today}.md").write_text("\n".join(header + out) + "\n")
    summary = {
        "http": http_ratio,
        "http_skip_hash": http_unhashed,
        "http_paced": paced_ratio,
        "s3": s3_ratio,
        "s3_skip_hash": s3_unhashed,
        "loader": loader_ratio,
        "loader_ustar": ustar_ratio,
        "local_warm": local_ratio,
    }
    raw = {
        "date": today,
        "command": command.strip(),
        "machine": machine(),
        "args": vars(args) | {"images": str(args.images)},
    }
    (RESULTS / f"index_bench-{today}.json").write_text(
        json.dumps({**raw, "num_bytes": num_bytes, "ratios": summary, "rows": record}, indent=1) + "\n"
    )
    print(f"written: {RESULTS / f'index_bench-{today}.md'} and .json")


if __name__ == "__main__":
    main()
