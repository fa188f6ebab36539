"""`raywds ray` with its data and its run folder in a bucket of a real S3 server (SeaweedFS, tests/support/s3server.py),
run as a user runs it: the CLI in a process of its own, which starts a private local Ray cluster
(RAY_ADDRESS=local, its own temp dir and token) whose workers find the store through the AWS variables."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from support.data import audited, tar_keys
from support.mlflowserver import MlflowServer
from support.raycluster import token_env, write_token
from support.runs import small_config
from support.s3server import S3Server

from raywds.data.upload import upload
from raywds.train.doctor import diagnose

RAYWDS = [sys.executable, "-m", "raywds"]


def ray_env(ray_temp: Path) -> dict[str, str]:
    """This process's environment (with the test bucket's AWS variables), for a private local cluster."""
    env = token_env(write_token(ray_temp))
    env.update(RAY_ADDRESS="local", RAY_TMPDIR=str(ray_temp), PYTHONUNBUFFERED="1")
    return env


def config_file(tmp_path: Path, data: str, audit: Path, **overrides: object) -> Path:
    cfg = small_config(data, mode="split", audit_dir=str(audit), batch_size=4, pg_timeout=60, **overrides)
    path = tmp_path / "config.json"
    saved = cfg.to_dict()  # by section; --data and the run's own folder come from the command
    del saved["data"]["data"], saved["run"]["out"]
    path.write_text(json.dumps(saved))
    return path


def objects(s3: S3Server, prefix: str) -> set[str]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix)
    return {item["Key"][len(prefix) :] for page in pages for item in page.get("Contents", [])}


def pid_of(keys_file: Path) -> int:
    return int(keys_file.name.rsplit("-pid", 1)[1].split(".")[0])


def kill_rank1_in(audit: Path, epoch: int, killed: list[int], deadline_s: float = 300.0) -> None:
    """SIGKILL rank 1's worker as soon as it starts epoch `epoch` (0-based), once: by then Ray has
    registered an earlier epoch's checkpoint in the bucket (the next may be in flight)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for f in audit.glob(f"epoch{epoch:04d}-rank00001-*.ids"):
            pid = pid_of(f)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.05)


def test_a_ray_run_in_a_bucket_survives_a_killed_worker_exactly_and_keeps_its_record_there(
    s3: S3Server, shards: Path, tmp_path: Path, ray_temp: Path, mlflow_server: MlflowServer
) -> None:
    """Rank 1 SIGKILLed as it starts epoch 3 of a run whose data and folder are in the bucket: Ray
    restarts the group from the last checkpoint, every epoch stays exact, the record stays in the
    bucket; with --tracking mlflow the restarted group logs to the same MLflow run (its id in the
    checkpoint Ray restarts from, and in the bucket's tracking.json)."""
    upload(shards, json.loads((shards / "manifest.json").read_text()), s3.url("data"))
    audit = tmp_path / "audit"
    config = config_file(tmp_path, s3.url("data"), audit, epochs=3, loader_workers=1)
    experiment = f"killed-{s3.bucket}"
    killed: list[int] = []
    killer = threading.Thread(target=kill_rank1_in, args=(audit, 2, killed), daemon=True)
    killer.start()
    run = subprocess.run(
        [*RAYWDS, "ray", "--data", s3.url("data"), "--config", str(config), "--num-workers", "2", "--tensorboard"]
        + ["--storage-path", s3.url("runs"), "--name", "r1", "--max-failures", "1", "--tracking", "mlflow"],
        env={**ray_env(ray_temp), **mlflow_server.env(experiment)},
        capture_output=True,
        text=True,
        timeout=420,
    )
    killer.join(timeout=5)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert killed, "the test never saw epoch 3 start"
    assert f"results {s3.url('runs/r1')}" in run.stdout and f"checkpoint {s3.url('runs/r1/checkpoint_')}" in run.stdout

    everything = Counter(tar_keys(shards))
    first = {pid_of(f) for f in audit.glob("epoch0000-*.ids")}
    assert killed[0] in first and len(first) == 2
    for epoch in range(3):  # each epoch as its last group of workers trained it: every sample once
        files = sorted(audit.glob(f"epoch{epoch:04d}-*.ids"))
        last = [f for f in files if pid_of(f) not in first] or files
        assert audited(last, shards) == everything, f"epoch {epoch + 1}"
    restarted = sorted(f.name for f in audit.glob("*.ids") if pid_of(f) not in first)
    assert restarted and not restarted[0].startswith("epoch0000"), f"the restart began at epoch 1: {restarted}"
    rank1 = {pid_of(f) for f in audit.glob("*-rank00001-*.ids")}
    assert len(rank1 - set(killed)) == 1, f"rank 1 ran in two processes, the killed one and its replacement: {rank1}"

    held = objects(s3, "runs/r1/")
    assert {"metrics.jsonl", "raywds-config.json", "best/checkpoint.pt", "best/metrics.json", "tracking.json"} <= held
    [tracked] = mlflow_server.runs(experiment)
    epochs_logged = mlflow_server.client().get_metric_history(tracked.info.run_id, "epoch")
    assert {1, 3} <= {int(m.value) for m in epochs_logged}, "before the kill and after the restart: one run"
    saved = s3.client().get_object(Bucket=s3.bucket, Key="runs/r1/tracking.json")["Body"].read()
    assert json.loads(saved) == {"mlflow": tracked.info.run_id}
    assert any(name.startswith("tensorboard/events.out.tfevents.") for name in held)
    assert any(name.startswith("checkpoint_") for name in held), "Ray's own checkpoints are in the bucket"
    rows = [
        json.loads(line)
        for line in s3.client().get_object(Bucket=s3.bucket, Key="runs/r1/metrics.jsonl")["Body"].read().splitlines()
    ]
    epochs = [r for r in rows if "train_loss" in r]
    assert sorted({r["epoch"] for r in epochs}) == [1, 2, 3], "the restarted rank 0 added to the record"
    last = epochs[-1]
    assert (last["epoch"], last["step"]) == (3, 3 * 16), "ranks hold 64 and 56 samples: 16 batches of 4 an epoch"
    assert (last["epoch_samples"], last["epoch_duplicates"], last["epoch_missing"]) == (120, 0, 0), last
    best = json.loads(s3.client().get_object(Bucket=s3.bucket, Key="runs/r1/best/metrics.json")["Body"].read())
    assert best["val_top1"] == max(r["val_top1"] for r in rows if "val_top1" in r)

    report = subprocess.run(
        [*RAYWDS, "report", s3.url("runs/r1"), "--out", str(tmp_path / "report.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "(3 epochs)" in report.stdout and (tmp_path / "report.png").stat().st_size > 10_000


def test_three_ranks_on_the_ray_data_plane_read_split_epochs_from_a_bucket_exactly(
    s3: S3Server, uneven: Path, tmp_path: Path, ray_temp: Path
) -> None:
    """Ray Data's read tasks, in worker processes of the cluster, open the shards in the bucket; three
    Ray Train ranks on two CPUs, split mode on 9 shards of 1..30 samples: every sample once each
    epoch by the audit files and by the trainers' own ledger, and the plane's stages in the record,
    which the doctor reads. The shards are named as a WebDataset user names them in a bucket, a
    brace list and a glob, not by a manifest: the driver indexes them (streamed from the bucket)
    and the plane's read tasks read them with the labels the index found."""
    upload(uneven, json.loads((uneven / "manifest.json").read_text()), s3.url("data"))
    audit = tmp_path / "audit"
    shards = s3.url("data") + "/uneven-train-{000000..000008}.tar"
    config = config_file(
        tmp_path,
        shards,
        audit,
        epochs=2,
        val_data=s3.url("data") + "/imagenet-val-*.tar",
        index_cache=str(tmp_path / "index"),
    )
    run = subprocess.run(
        [*RAYWDS, "ray", "--data", shards, "--config", str(config), "--num-workers", "3"]
        + ["--data-plane", "ray", "--storage-path", str(tmp_path / "runs"), "--name", "plane"],
        # 4 logical CPUs (Ray's own override of what a node has), as `ray start --num-cpus 4` gives:
        # a trainer a CPU each, and one for the plane's tasks, on a 2-core machine
        env={**ray_env(ray_temp), "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 4})},
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "training on 3 CPU (gloo) workers" in run.stdout, run.stdout[-3000:]
    assert "decoding on Ray Data tasks" in run.stdout
    assert re.search(r"indexed s3://\S+ \(9 train shards, \d+ val shards, 170 samples\)", run.stdout), run.stdout[:2000]
    assert "Traceback" not in run.stdout + run.stderr
    everything = Counter(tar_keys(uneven))
    for epoch in (0, 1):
        files = sorted(audit.glob(f"epoch{epoch:04d}-*.ids"))
        assert len({f.name.split("-")[1] for f in files}) == 3, "all three ranks trained"
        assert audited(files, uneven) == everything, f"epoch {epoch + 1}"
    rows = [json.loads(line) for line in (tmp_path / "runs" / "plane" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if "train_loss" in r]
    assert [r["epoch"] for r in epochs] == [1, 2], rows
    assert all((r["epoch_samples"], r["epoch_duplicates"], r["epoch_missing"]) == (120, 0, 0) for r in epochs), rows
    last = epochs[-1]
    assert last["val_samples"] == 50, last
    stages = last["stages"]
    assert len(stages["host"]) == 3 and stages["data_plane"], stages
    assert stages["decoded"] == stages["samples"], "each rank's samples were timed in the plane's tasks"
    assert all(x > 0 for x in stages["read_s"] + stages["decode_s"] + stages["read_bytes"]), stages
    # Three ranks share two cores here: one may well be named slow first; the data's line follows
    lines = diagnose(last)
    assert any("the Ray Data plane, whose tasks made" in x or x.startswith("the data is not") for x in lines), lines
    even = [n * sum(stages["own_s"]) / sum(stages["samples"]) for n in stages["samples"]]  # no rank slower
    waiting = {**last, "stages": {**stages, "own_s": even, "wait_s": [0.9 * s for s in stages["seconds"]]}}
    verdict, fix = diagnose(waiting)[:2]  # as if every rank had waited: the plane's tasks are named, with numbers
    assert re.search(r"its batches come from the Ray Data plane, whose tasks made [\d,]+ images/s a CPU", verdict)
    assert fix.startswith("1. more CPUs for the plane's tasks, about "), fix
