"""A run's folder in a bucket of a real S3 server (raywds.runs.bucket): what rank 0 writes is in
the bucket as soon as it is written, and a restarted rank 0 adds to the run's record."""

from __future__ import annotations

import io
import json
import logging
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.s3proxy import S3Proxy
from support.s3server import S3Server

from raywds.errors import StorageError
from raywds.launch.runstore import load_ray_checkpoint, ray_storage
from raywds.runs.bucket import BucketRunDir


def rows(s3: S3Server, key: str) -> list[dict]:
    body = s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    return [json.loads(line) for line in body.splitlines()]


def state(value: float) -> dict:
    return {"model": {"w": torch.full((2,), value)}, "steps": 1}


def test_each_row_and_a_better_best_are_in_the_bucket_at_once_and_a_restart_adds_to_them(s3: S3Server) -> None:
    url = s3.url("runs/r1")
    first = BucketRunDir(url)
    first.start()
    first.record({"epoch": 1, "train_loss": 2.0, "val_top1": 0.5}, state(1.0))
    assert rows(s3, "runs/r1/metrics.jsonl") == [{"epoch": 1, "train_loss": 2.0, "val_top1": 0.5}]
    first.append({"kind": "progress", "step": 7, "loss": 1.5})
    assert len(rows(s3, "runs/r1/metrics.jsonl")) == 2, "a progress row goes up too"
    local = first.path
    first.close()
    assert not local.exists(), "the local copy is removed"

    restarted = BucketRunDir(url)  # a new process after a failure: what the bucket holds comes first
    restarted.start()
    restarted.record({"epoch": 2, "train_loss": 1.0, "val_top1": 0.25}, state(2.0))
    assert rows(s3, "runs/r1/best/metrics.json")[0]["epoch"] == 1, "a worse top-1 than the bucket's best/ keeps it"
    restarted.record({"epoch": 3, "train_loss": 0.5, "val_top1": 0.75}, state(3.0))
    restarted.close()
    assert [r.get("epoch") for r in rows(s3, "runs/r1/metrics.jsonl")] == [1, None, 2, 3]
    assert rows(s3, "runs/r1/best/metrics.json")[0]["epoch"] == 3
    body = s3.client().get_object(Bucket=s3.bucket, Key="runs/r1/best/checkpoint.pt")["Body"].read()
    assert torch.load(io.BytesIO(body), weights_only=True)["model"]["w"].tolist() == [3.0, 3.0]


def test_a_row_the_store_refuses_is_a_warning_and_goes_up_with_the_next(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    run = BucketRunDir(s3.url("runs/r2"))
    run.start()
    secret = s3.env()["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with caplog.at_level(logging.WARNING):
        run.append({"epoch": 1, "train_loss": 2.0})
    assert "could not put metrics.jsonl" in caplog.text and "refused the credentials" in caplog.text
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    run.append({"epoch": 2, "train_loss": 1.0})
    assert [r["epoch"] for r in rows(s3, "runs/r2/metrics.jsonl")] == [1, 2]
    run.close()


def bucket_checkpoint(s3: S3Server, key: str, body: Path, endpoint: str | None = None) -> Any:
    """`body` put in the bucket as `key`/checkpoint.pt, and the `ray.train.Checkpoint` Ray would hand
    a restarted rank for it (through the file system `raywds ray` gives Ray for this store, at
    `endpoint` if given, else the store's own)."""
    import ray.train

    s3.client().upload_file(str(body), s3.bucket, f"{key}/checkpoint.pt")
    storage = ray_storage(s3.url(""), endpoint)
    return ray.train.Checkpoint(storage["storage_path"] + key, filesystem=storage["storage_filesystem"])


FIRST_RANK = """
import pickle, sys
checkpoint = pickle.loads(open(sys.argv[1], "rb").read())
with checkpoint.as_directory() as where:
    print(where, flush=True)
    sys.stdin.readline()
"""
"""The first rank on a node, restarting: Ray's own way of reading the checkpoint (handed over pickled, as
Ray hands it to each rank), held open until the test writes a line."""


def test_a_restarted_rank_reads_the_checkpoint_in_the_bucket_without_rewriting_another_ranks_copy(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks on one node restart from the same checkpoint in the bucket. The second must not
    download into the folder the first is still reading: Ray's as_directory() folder, shared by the
    node, was written again under the first rank, which then read a damaged checkpoint.pt."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where both ranks download, so it can be looked at
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    saved = tmp_path / "saved.pt"
    torch.save(state(5.0), saved)
    checkpoint = bucket_checkpoint(s3, "runs/r3/checkpoint_000001", saved)
    (tmp_path / "checkpoint.pickle").write_bytes(pickle.dumps(checkpoint))
    first = subprocess.Popen(
        [sys.executable, "-c", FIRST_RANK, str(tmp_path / "checkpoint.pickle")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdin is not None
        theirs = Path(first.stdout.readline().strip()) / "checkpoint.pt"
        before = (theirs.stat().st_ino, theirs.stat().st_mtime_ns)
        time.sleep(0.05)
        assert load_ray_checkpoint(checkpoint)["model"]["w"].tolist() == [5.0, 5.0]
        assert (theirs.stat().st_ino, theirs.stat().st_mtime_ns) == before, "the first rank's copy was written again"
        first.stdin.write("done\n")
        first.stdin.flush()
        assert first.wait(timeout=60) == 0
    finally:
        first.kill()
    assert not list(tmp_path.glob("raywds-restart-*")), "the second rank's own copy is removed"


def test_a_damaged_checkpoint_in_the_bucket_is_named_by_its_address_there(s3: S3Server, tmp_path: Path) -> None:
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 not a whole checkpoint")
    checkpoint = bucket_checkpoint(s3, "runs/r4/checkpoint_000002", tmp_path / "cut.pt")
    with pytest.raises(StorageError) as raised:
        load_ray_checkpoint(checkpoint)
    assert str(raised.value).startswith(f"checkpoint {s3.url('runs/r4/checkpoint_000002/checkpoint.pt')} is damaged (")
    assert str(raised.value).endswith("; Ray restarted the run from it: run again under a new --name"), raised.value
    assert "--resume" not in str(raised.value) and "raywds-restart-" not in str(raised.value)


@pytest.mark.slow
def test_a_restarted_rank_waits_for_a_store_that_pauses_before_it_answers(s3: S3Server, tmp_path: Path) -> None:
    """A loaded store that holds its answer back 5 s, the checkpoint's download (Ray's to_directory,
    through the file system `raywds ray` gives Ray) included. pyarrow's S3 client gives up on a
    transfer that has moved nothing for 3 s (the AWS SDK's default, curl's low-speed time), which
    once failed a restart under load (`Operation too slow. Less than 1 bytes/sec transferred the
    last 3 seconds`); the run store waits 60 s, as raywds's own S3 reads do."""
    saved = tmp_path / "saved.pt"
    torch.save(state(7.0), saved)
    with S3Proxy(s3, path=r"/checkpoint\.pt$") as proxy:
        checkpoint = bucket_checkpoint(s3, "runs/r5/checkpoint_000001", saved, endpoint=proxy.endpoint)
        proxy.pause_s = 5.0
        started = time.monotonic()
        restored = load_ray_checkpoint(checkpoint)
        assert proxy.num_pauses >= 1 and time.monotonic() - started >= 5.0
    assert torch.equal(restored["model"]["w"], torch.full((2,), 7.0))
