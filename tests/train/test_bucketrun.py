"""A run's folder in a bucket of a real S3 server (raywds.train.bucketrun): what rank 0 writes is in
the bucket as soon as it is written, and a restarted rank 0 adds to the run's record."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch
from support.s3server import S3Server

from raywds.train.bucketrun import BucketRunDir


def rows(s3: S3Server, key: str) -> list[dict]:
    body = s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    return [json.loads(line) for line in body.splitlines()]


def state(value: float) -> dict:
    return {"model": {"w": torch.full((2,), value)}, "steps": 1}


def test_each_row_and_a_better_best_are_in_the_bucket_at_once_and_a_restart_adds_to_them(s3: S3Server) -> None:
    url = s3.url("runs/r1")
    first = BucketRunDir(url)
    first.record({"epoch": 1, "train_loss": 2.0, "val_top1": 0.5}, state(1.0))
    assert rows(s3, "runs/r1/metrics.jsonl") == [{"epoch": 1, "train_loss": 2.0, "val_top1": 0.5}]
    first.append({"kind": "progress", "step": 7, "loss": 1.5})
    assert len(rows(s3, "runs/r1/metrics.jsonl")) == 2, "a progress row goes up too"
    local = first.path
    first.close()
    assert not local.exists(), "the local copy is removed"

    restarted = BucketRunDir(url)  # a new process after a failure: what the bucket holds comes first
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
    secret = s3.env()["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with caplog.at_level(logging.WARNING):
        run.append({"epoch": 1, "train_loss": 2.0})
    assert "could not put metrics.jsonl" in caplog.text and "refused the credentials" in caplog.text
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    run.append({"epoch": 2, "train_loss": 1.0})
    assert [r["epoch"] for r in rows(s3, "runs/r2/metrics.jsonl")] == [1, 2]
    run.close()
