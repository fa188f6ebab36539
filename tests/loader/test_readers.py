"""Shard readers against real servers on loopback that fail the way networks do: missing
shards, a server killed mid-read, a server that stalls, a connection dropped mid-body."""

from __future__ import annotations

import dataclasses
import http.server
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.data import tar_keys
from support.runs import small_config

from raywds.data.cache import cache_path
from raywds.data.http import ReadPolicy
from raywds.data.manifest import read_manifest
from raywds.data.stores import open_shard
from raywds.errors import ShardError
from raywds.loader.loader import train_loader, val_loader
from raywds.loader.readers import Expected, Failures, Prefetch, tar_samples
from raywds.plan.modes import epoch_plan
from raywds.serve import ShardServer, free_port
from raywds.train.config import TrainConfig
from raywds.world import World

FAST = ReadPolicy(read_timeout_s=2.0, retries=2, backoff_s=0.1)


def cfg(data: str, **overrides: object) -> TrainConfig:
    return small_config(data, **{"batch_size": 8, "image_size": 16, "read_retries": 1, **overrides})


@pytest.fixture
def holed(shards: Path, tmp_path: Path) -> Path:
    """The test shards with one train shard deleted (the manifest still lists it)."""
    out = tmp_path / "holed"
    shutil.copytree(shards, out)
    (out / read_manifest(str(shards)).shards("train")[2].name).unlink()
    return out


def test_loaders_read_the_same_samples_over_http(shards: Path) -> None:
    with ShardServer(shards, backend="embedded") as server:
        manifest = read_manifest(server.url)
        seen = Counter(k for b in val_loader(manifest, cfg(server.url).loader(), World()) for k in b.keys)
    assert seen == Counter(tar_keys(shards, "val"))


def test_a_missing_shard_in_split_mode_is_an_error_naming_it(holed: Path) -> None:
    missing = read_manifest(str(holed)).shards("train")[2].name
    with ShardServer(holed, backend="embedded") as server:
        c = cfg(server.url, mode="split", loader_workers=0)
        manifest = read_manifest(server.url)
        loader = train_loader(manifest, c.loader(), World(), epoch_plan(manifest, c, 1, epoch=0), epoch=0)
        with pytest.raises(ShardError, match=rf"shard {server.url}/{missing} is missing on the server \(HTTP 404\)"):
            list(loader)


def test_a_missing_shard_in_resample_mode_is_skipped_and_counted(holed: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = read_manifest(str(holed)).shards("train")[2].name
    with ShardServer(holed, backend="embedded") as server:
        c = cfg(server.url, loader_workers=0, batches_per_epoch=40)
        manifest = read_manifest(server.url)
        batches = list(train_loader(manifest, c.loader(), World(), epoch_plan(manifest, c, 1, epoch=0), epoch=0))
    assert len(batches) == 40 and all(len(b.keys) == 8 for b in batches), "batch counts stay exact"
    warnings = [r.getMessage() for r in caplog.records if "skipped an unreadable shard" in r.getMessage()]
    assert warnings and f"{missing} is missing on the server" in warnings[0]
    assert warnings[-1].endswith(f"; {len(warnings)} skipped by this loader worker")
    skipped = [reason for b in batches for reason in b.bad_shards]
    assert len(skipped) == len(warnings) and all(missing in reason for reason in skipped), (
        "the batches carry each skip to the training loop"
    )


def test_resample_gives_up_when_the_server_is_gone(shards: Path, short_backoff: None) -> None:
    with ShardServer(shards, backend="embedded") as server:
        manifest = read_manifest(server.url)
    c = cfg(server.url, loader_workers=0, read_retries=1)
    start = time.monotonic()
    with pytest.raises(
        ShardError,
        match=(
            r"5 shards in a row were unreadable, the last: shard http://127\.0\.0\.1:\d+/.*: cannot read it .*; is the "
            r"shard server down\?"
        ),
    ):
        list(train_loader(manifest, c.loader(), World(), epoch_plan(manifest, c, 1, epoch=0), epoch=0))
    assert time.monotonic() - start < 30


def _serve_directory(root: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("test server did not start")


def test_a_server_killed_mid_read_is_an_error_naming_the_url_in_bounded_time(tmp_path: Path) -> None:
    (tmp_path / "big.tar").write_bytes(os.urandom(64 << 20))  # larger than the socket buffers
    port = free_port("127.0.0.1")
    proc = _serve_directory(tmp_path, port)
    url = f"http://127.0.0.1:{port}/big.tar"
    try:
        stream = open_shard(url, FAST, size=64 << 20)
        assert len(stream.read(1 << 16)) == 1 << 16
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        start = time.monotonic()
        with pytest.raises(ShardError, match=rf"shard {url}: cannot read it at byte \d+: .* \(after 2 retries\)"):
            while stream.read(1 << 20):
                pass
        assert time.monotonic() - start < 10
    finally:
        proc.kill()


@pytest.fixture
def odd_server(tmp_path: Path) -> Iterator[tuple[str, list[dict[str, str]], bytes]]:
    """A loopback server whose /drop.tar drops the connection mid-body on the first GET, and
    whose /stall.tar sends headers and then nothing."""
    body = os.urandom(300_000)
    requests: list[dict[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            requests.append({"path": self.path, "range": self.headers.get("Range", "")})
            start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers.get("Range") else 0
            self.send_response(206 if start else 200)
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            if self.path == "/stall.tar":
                time.sleep(5)
                return
            if self.path == "/drop.tar" and len(requests) == 1:
                self.wfile.write(body[start : start + 100_000])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(body[start:])

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    # polls for shutdown() every 0.05 s, not socketserver's 0.5 s: the test ends that much sooner
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests, body
    finally:
        server.shutdown()
        server.server_close()


def test_a_dropped_connection_resumes_with_a_range_request(odd_server: tuple[str, list[dict[str, str]], bytes]) -> None:
    base, requests, body = odd_server
    with open_shard(f"{base}/drop.tar", FAST, size=len(body)) as stream:
        assert stream.read() == body
    assert (
        requests[0]["range"] == "" and requests[1]["range"].startswith("bytes=") and requests[1]["range"] != "bytes=0-"
    )


@pytest.mark.parametrize("size", [True, False], ids=["size known", "size unknown"])
def test_a_shard_read_whole_is_read_in_large_pieces(
    odd_server: tuple[str, list[dict[str, str]], bytes], monkeypatch: pytest.MonkeyPatch, size: bool
) -> None:
    """A shard read to its end with .read() (the closing blocks after its last sample, or a
    --cache-dir copy): io.RawIOBase's own readall would ask the HTTP client for 8 KiB at a time
    (37 reads of this 300 KB body; 1,600 of a 13 MB shard, a fifth of a loader worker's time on
    a local S3 store)."""
    from raywds.data.http import HttpShard

    base, _, body = odd_server
    calls = []
    original = HttpShard.readinto
    monkeypatch.setattr(HttpShard, "readinto", lambda self, buffer: calls.append(len(buffer)) or original(self, buffer))
    with open_shard(f"{base}/whole.tar", FAST, size=len(body) if size else None) as stream:
        assert stream.read() == body
    assert calls[0] >= len(body) and len(calls) <= 20, calls  # what has arrived at each read; all of it asked for


def test_a_prefetched_shard_is_held_once_in_memory(tmp_path: Path) -> None:
    """The shard fetched ahead is read into its buffer straight from the socket, never copied
    whole (a .read() filled a bytearray and then copied it into bytes: the shard twice at the
    peak, and a 33 MB shard cost 17 ms of a loader worker's CPU); the next shard that fits is read
    into the same buffer, not a fresh one."""
    body, smaller = os.urandom(8 << 20), os.urandom(6 << 20)
    (tmp_path / "big.tar").write_bytes(body)
    (tmp_path / "small.tar").write_bytes(smaller)
    (tmp_path / "manifest.json").write_text("{}")  # what the server asks of a shard folder
    buffers = [bytearray(), bytearray()]
    with ShardServer(tmp_path, backend="embedded") as server:
        tracemalloc.start()
        try:
            big = Expected(num_samples=1, num_bytes=len(body))
            stream = Prefetch(f"{server.url}/big.tar", FAST, big, Failures(FAST), buffers, 1).stream()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert stream.read() == body
        stream.close()
        held = buffers[1]
        small = Expected(num_samples=1, num_bytes=len(smaller))
        again = Prefetch(f"{server.url}/small.tar", FAST, small, Failures(FAST), buffers, 1).stream()
        head = bytearray(100)  # readinto, as --verify-hashes reads it
        assert again.readinto(head) == 100 and bytes(head) + again.read(100) + again.read() == smaller
        assert again.readinto(bytearray(8)) == 0
        assert buffers[1] is held and len(held) == len(body)
    size = len(body)
    assert peak < 1.5 * size, f"{peak / size:.2f}x the shard"  # its 1 MiB read buffer beside it


def test_a_stalled_server_times_out(odd_server: tuple[str, list[dict[str, str]], bytes]) -> None:
    base, _, _ = odd_server
    policy = ReadPolicy(read_timeout_s=0.5, retries=1, backoff_s=0.1)
    start = time.monotonic()
    with pytest.raises(ShardError, match=rf"shard {base}/stall.tar: cannot read it .*timed out"):
        open_shard(f"{base}/stall.tar", policy).read()
    assert time.monotonic() - start < 5


def test_cache_dir_keeps_a_complete_copy(shards: Path, tmp_path: Path) -> None:
    shard = read_manifest(str(shards)).shards("train")[0]
    policy = ReadPolicy(cache_dir=str(tmp_path / "cache"))
    with ShardServer(shards, backend="embedded") as server:
        url = f"{server.url}/{shard.name}"
        with open_shard(url, policy, size=shard.num_bytes, sha256=shard.sha256) as stream:
            assert stream.read() == (shards / shard.name).read_bytes()
    assert cache_path(policy.cache_dir or "", url).read_bytes() == (shards / shard.name).read_bytes()
    with open_shard(url, policy, size=shard.num_bytes) as stream:  # the server is gone: from the cache
        assert stream.read() == (shards / shard.name).read_bytes()


@pytest.mark.parametrize("prefetch_bytes", [0, 256 << 20])
def test_cache_dir_keeps_every_shard_a_pass_reads(shards: Path, tmp_path: Path, prefetch_bytes: int) -> None:
    """Streamed (the first shard, or no prefetch) or fetched whole ahead: every shard read to its
    last sample is cached, though a tar's last sample comes before its closing blocks."""
    manifest = read_manifest(str(shards))
    policy = ReadPolicy(cache_dir=str(tmp_path / "cache"), prefetch_bytes=prefetch_bytes)
    with ShardServer(shards, backend="embedded") as server:
        listed = {f"{server.url}/{s.name}": s for s in manifest.shards("train")}
        entries = {u: Expected(s.num_samples, s.num_bytes, s.sha256) for u, s in listed.items()}
        assert sum(1 for _ in tar_samples([{"url": u} for u in listed], policy, entries)) == 120
    for url, shard in listed.items():
        assert cache_path(policy.cache_dir or "", url).read_bytes() == (shards / shard.name).read_bytes(), url


@pytest.mark.parametrize("prefetch_bytes", [256 << 20, 0])
def test_the_next_local_shard_is_read_ahead(shards: Path, tmp_path: Path, prefetch_bytes: int) -> None:
    """While the first shard is decoded, the next one is read whole (a file, as a remote shard):
    its file emptied after the read-ahead finished still gives every sample. Without prefetching
    it is opened in its turn, and the emptied file is an error."""
    first, second = read_manifest(str(shards)).shards("train")[:2]
    for shard in (first, second):
        shutil.copy(shards / shard.name, tmp_path / shard.name)
    urls = [str(tmp_path / first.name), str(tmp_path / second.name)]
    entries = {u: Expected(s.num_samples, s.num_bytes, s.sha256) for u, s in zip(urls, (first, second))}
    samples = tar_samples([{"url": u} for u in urls], ReadPolicy(prefetch_bytes=prefetch_bytes), entries)
    keys = [next(samples)["__key__"]]
    for thread in threading.enumerate():
        if thread.name == "prefetch":
            thread.join()
    (tmp_path / second.name).write_bytes(b"")
    if prefetch_bytes:
        keys += [sample["__key__"] for sample in samples]
        assert keys == tar_keys(shards)[: first.num_samples + second.num_samples]
    else:
        with pytest.raises(ShardError, match=second.name):
            list(samples)


def test_cache_dir_refuses_a_copy_that_does_not_match_the_manifest(shards: Path, tmp_path: Path) -> None:
    shard = read_manifest(str(shards)).shards("train")[0]
    policy = ReadPolicy(cache_dir=str(tmp_path / "cache"))
    with ShardServer(shards, backend="embedded") as server:
        url = f"{server.url}/{shard.name}"
        with open_shard(url, policy, size=shard.num_bytes, sha256="0" * 64) as stream:
            stream.read()
    assert not cache_path(policy.cache_dir or "", url).exists()


def test_pipe_urls_and_local_paths(shards: Path) -> None:
    shard = read_manifest(str(shards)).shards("train")[0]
    data = (shards / shard.name).read_bytes()
    with open_shard(f"pipe:cat {shards / shard.name}", FAST) as stream:
        assert stream.read() == data
    with pytest.raises(ShardError, match=r"shard .*/nope\.tar: cannot open it: No such file or directory"):
        open_shard(str(shards / "nope.tar"), FAST)


def test_shards_elsewhere_through_a_pipe_template(shards: Path, tmp_path: Path) -> None:
    """The manifest here, the shards behind a command (as with `pipe:aws s3 cp s3://bucket/{} -`)."""
    (tmp_path / "manifest.json").write_bytes((shards / "manifest.json").read_bytes())
    template = f"pipe:cat {shards}/{{}}"
    manifest = read_manifest(str(tmp_path), shards_at=template)
    assert manifest.url(manifest.shards("val")[0]) == f"pipe:cat {shards}/imagenet-val-000000.tar"
    c = cfg(str(tmp_path), shards_at=template, mode="split")
    seen = Counter(k for b in val_loader(manifest, c.loader(), World()) for k in b.keys)
    assert seen == Counter(tar_keys(shards, "val"))
    trained = Counter(
        k
        for b in train_loader(manifest, c.loader(), World(), epoch_plan(manifest, c, 1, epoch=0), epoch=0)
        for k in b.keys
    )
    hashed = dataclasses.replace(c, verify_hashes=True)  # a pipe: stream has no readinto
    assert Counter(k for b in val_loader(manifest, hashed.loader(), World()) for k in b.keys) == Counter(
        tar_keys(shards, "val")
    )
    assert trained == Counter(tar_keys(shards))


def test_shards_at_two_servers_share_the_shards_and_read_every_sample(shards: Path, tmp_path: Path) -> None:
    """`--shards-at` naming two servers of the same folder: each shard always from the same one,
    both used, every sample read; with one server gone, its shards fail naming it."""
    (tmp_path / "manifest.json").write_bytes((shards / "manifest.json").read_bytes())
    with ShardServer(shards, backend="embedded", host="127.0.0.1") as one:
        with ShardServer(shards, backend="embedded", host="127.0.0.1") as two:
            manifest = read_manifest(str(tmp_path), shards_at=f"{one.url}, {two.url}/")
            urls = [manifest.url(s) for s in manifest.shards("train")]
            assert urls == [manifest.url(s) for s in manifest.shards("train")], "the same server each time"
            assert {u.rsplit("/", 1)[0] for u in urls} == {one.url, two.url}, urls
            c = cfg(str(tmp_path), shards_at=f"{one.url},{two.url}", mode="split")
            plan = epoch_plan(manifest, c, 1, epoch=0)
            trained = Counter(k for b in train_loader(manifest, c.loader(), World(), plan, epoch=0) for k in b.keys)
            assert trained == Counter(tar_keys(shards))
        gone = next(u for u in urls if u.startswith(two.url))
        quick = dataclasses.replace(c, read_retries=0, read_timeout=2)
        with pytest.raises(ShardError, match=re.escape(gone)):
            list(train_loader(manifest, quick.loader(), World(), plan, epoch=0))
