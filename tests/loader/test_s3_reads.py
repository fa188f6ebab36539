"""Reading shards from a bucket (raywds.data.http.S3Shard) against a real S3 server, with a
proxy that throttles (503 SlowDown) and resets connections mid-body; and training from it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.runs import small_config
from support.s3proxy import S3Proxy
from support.s3server import S3Server

from raywds.data.http import ReadPolicy
from raywds.data.manifest import read_manifest
from raywds.data.stores import open_shard
from raywds.data.upload import upload
from raywds.errors import ShardError
from raywds.loader.readers import Expected, tar_samples
from raywds.runs.folder import RunDir
from raywds.train.trainer import train
from raywds.world import World

FAST = ReadPolicy(read_timeout_s=5.0, retries=3, backoff_s=0.01)


@pytest.fixture
def bucket_shards(s3: S3Server, shards: Path) -> str:
    """The test shards (tests/conftest.py `shards`) uploaded to the test's bucket; their s3:// prefix."""
    import json

    upload(shards, json.loads((shards / "manifest.json").read_text()), s3.url("shards"))
    return s3.url("shards")


def test_a_throttled_and_reset_read_resumes_at_the_byte_and_gets_every_byte(
    s3: S3Server, bucket_shards: str, shards: Path
) -> None:
    """SlowDown on every 2nd GET and a reset after 3,000 bytes on all the others: the stream
    still gives the shard's exact bytes; the retries asked for the rest from where they stopped."""
    manifest = read_manifest(bucket_shards)
    shard = manifest.shards("train")[0]
    with S3Proxy(s3) as proxy:
        proxy.slowdown_every, proxy.reset_every, proxy.reset_after_bytes = 2, 1, 3000
        policy = ReadPolicy(read_timeout_s=5.0, retries=3, backoff_s=0.01, s3_endpoint=proxy.endpoint)
        with open_shard(manifest.url(shard), policy, size=shard.num_bytes) as stream:
            data = stream.read()
    assert data == (shards / shard.name).read_bytes()
    assert proxy.num_slowdowns >= 1 and proxy.num_resets >= 1, (proxy.num_slowdowns, proxy.num_resets)
    ranges = [r for method, path, r in proxy.log if method == "GET" and path.endswith(shard.name)]
    assert ranges[0] is None and any(r is not None and r.startswith("bytes=") and r != "bytes=0-" for r in ranges)
    resumed_at = [int(r.removeprefix("bytes=").rstrip("-")) for r in ranges if r]
    assert all(0 < at < shard.num_bytes for at in resumed_at), ranges


def test_retry_after_is_honoured(s3: S3Server, bucket_shards: str) -> None:
    """The store's Retry-After (1 s) is waited, not our backoff of 10 ms."""
    manifest = read_manifest(bucket_shards)
    shard = manifest.shards("train")[0]
    with S3Proxy(s3) as proxy:
        proxy.slowdown_every, proxy.retry_after = 1, "1"
        policy = ReadPolicy(read_timeout_s=5.0, retries=2, backoff_s=0.01, s3_endpoint=proxy.endpoint)
        start = time.monotonic()
        with pytest.raises(ShardError) as error:
            open_shard(manifest.url(shard), policy, size=shard.num_bytes)
        waited = time.monotonic() - start
    assert waited >= 2.0, waited  # two waits of Retry-After's 1 s
    line = str(error.value)
    assert "\n" not in line and manifest.url(shard) in line and "HTTP 503 SlowDown" in line, line
    assert "after 2 retries" in line and "--read-retries" in line, line


def test_a_missing_object_and_a_dead_store_are_one_line_naming_the_object(s3: S3Server, bucket_shards: str) -> None:
    with pytest.raises(ShardError, match=r"no object 'shards/nope.tar' in bucket .* \(HTTP 404 NoSuchKey\)"):
        open_shard(f"{bucket_shards}/nope.tar", FAST)
    with S3Proxy(s3) as proxy:
        dead = proxy.endpoint
    policy = ReadPolicy(read_timeout_s=2.0, retries=2, backoff_s=0.01, s3_endpoint=dead)
    start = time.monotonic()
    with pytest.raises(ShardError, match=rf"shard {bucket_shards}/x.tar: cannot read it when opening it: .*{dead}"):
        open_shard(f"{bucket_shards}/x.tar", policy)
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("mode", ["split", "resample"])
def test_training_from_a_bucket_matches_training_from_the_folder(
    mode: str, bucket_shards: str, shards: Path, tmp_path: Path
) -> None:
    """The same run from s3:// and from the folder: the same samples (split mode's exactness
    check passes), the same loss."""
    here = train(small_config(shards, mode=mode, epochs=1), World())
    there = train(small_config(bucket_shards, mode=mode, epochs=1), World())
    assert there["samples_seen"] == here["samples_seen"] and there["val_samples"] == here["val_samples"] == 50
    assert there["train_loss"] == pytest.approx(here["train_loss"], rel=1e-5)


def test_the_next_shard_is_fetched_while_the_current_one_is_read(s3: S3Server, bucket_shards: str) -> None:
    """After the first sample of shard 0, shard 1's GET has started (one shard ahead, no more);
    with prefetching off it starts only when shard 0 is done. Every sample comes once, in order."""
    manifest = read_manifest(bucket_shards)
    urls = [manifest.url(s) for s in manifest.shards("train")[:3]]
    expected = dict(zip(urls, [Expected(s.num_samples, s.num_bytes, s.sha256) for s in manifest.shards("train")]))
    with S3Proxy(s3) as proxy:
        for prefetch_bytes, ahead in [(256 << 20, True), (0, False)]:
            proxy.log.clear()
            policy = ReadPolicy(
                read_timeout_s=5.0, backoff_s=0.01, s3_endpoint=proxy.endpoint, prefetch_bytes=prefetch_bytes
            )
            samples = tar_samples([{"url": u} for u in urls], policy, expected)
            first = next(samples)
            deadline = time.monotonic() + 10
            while ahead and len(proxy.log) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            asked = [path.rsplit("/", 1)[-1] for method, path, _ in proxy.log if method == "GET"]
            names = [u.rsplit("/", 1)[-1] for u in urls]
            assert asked == (names[:2] if ahead else names[:1]), (prefetch_bytes, asked)
            keys = [first["__key__"], *(s["__key__"] for s in samples)]
            assert len(keys) == len(set(keys)) == sum(e.num_samples for e in expected.values())


@pytest.mark.slow
def test_a_split_epoch_through_a_throttling_store_is_exact_and_counts_its_retries(
    s3: S3Server, bucket_shards: str, tmp_path: Path
) -> None:
    """Every 3rd GET of a train shard throttled, every 4th reset mid-body: the split epoch still
    trains each sample once, and metrics.jsonl counts one retry per fault."""
    with S3Proxy(s3, path=r"-train-\d+\.tar$") as proxy:
        proxy.slowdown_every, proxy.reset_every, proxy.reset_after_bytes = 3, 4, 2000
        cfg = small_config(bucket_shards, mode="split", epochs=1, s3_endpoint=proxy.endpoint)
        report = RunDir(tmp_path)
        train(cfg, World(), run_dir=report)
    row = json.loads(report.metrics_path.read_text().splitlines()[-1])
    assert (row["epoch_samples"], row["epoch_duplicates"], row["epoch_missing"]) == (120, 0, 0), row
    assert proxy.num_slowdowns >= 2 and proxy.num_resets >= 1, (proxy.num_slowdowns, proxy.num_resets)
    assert row["read_retries"] == proxy.num_slowdowns + proxy.num_resets, row


def test_loader_workers_do_not_share_the_parents_connection(s3: S3Server, bucket_shards: str, tmp_path: Path) -> None:
    """The training process has read from the store (a kept-alive connection in its cached
    client) before two loader workers fork: each worker must open its own, or both read
    answers off one socket (a retry at best, a shard skipped as an invalid tar at worst)."""
    from raywds.data import s3 as store

    manifest = read_manifest(bucket_shards)
    first = manifest.shards("train")[0]
    bucket, key = store.split(manifest.url(first))
    store.client(None, 60.0).get_object(Bucket=bucket, Key=key)["Body"].read()  # the loader's client, warm
    report = RunDir(tmp_path)
    cfg = small_config(bucket_shards, mode="split", epochs=4, loader_workers=2, read_retries=0)
    train(cfg, World(), run_dir=report)
    rows = [json.loads(line) for line in report.metrics_path.read_text().splitlines()]
    assert [(r["epoch_samples"], r["epoch_duplicates"], r["read_retries"]) for r in rows] == [(120, 0, 0)] * 4, rows
