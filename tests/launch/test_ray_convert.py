"""`raywds convert --ray`: the shards the local converter writes, byte for byte, from Ray tasks; an
append the same; a driver stopped by a signal (through `timeout`, or Ctrl-C's SIGINT) says so in
one line and the run again keeps what it wrote; from a bucket into a bucket, stopped and run
again, every shard written once. (The two-node run with its worker node killed:
tests/launch/test_multinode.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.planted import planted_slowness
from support.raycluster import token_env, write_token
from support.s3server import S3Server

from raywds.cli.main import main
from raywds.data.append import append
from raywds.data.convert import ConvertOptions, convert
from raywds.data.resume import JOURNAL

RAYWDS = [sys.executable, "-m", "raywds"]


def same_dataset(here: Path, there: Path) -> None:
    """The same shards, byte for byte, and the same manifest but for where the images came from
    (and how many shards an earlier run had finished); the same sha256 of each sample's image file."""
    assert sorted(p.name for p in there.glob("*.tar")) == sorted(p.name for p in here.glob("*.tar"))
    assert (there / "sources.npz").read_bytes() == (here / "sources.npz").read_bytes()
    for shard in here.glob("*.tar"):
        assert (there / shard.name).read_bytes() == shard.read_bytes(), f"{shard.name} differs"
    ours, theirs = (json.loads((d / "manifest.json").read_text()) for d in (here, there))
    for m in (ours, theirs):
        m.pop("source")
        m.pop("kept_from_earlier_run")
        for entry in m.get("appended", []):
            entry.pop("source")
    assert ours == theirs


def test_ray_tasks_write_the_local_converters_shards_and_append_as_it_does(
    tree: Path, tmp_path: Path, local_ray: None, capsys: pytest.CaptureFixture[str]
) -> None:
    here, there = tmp_path / "local", tmp_path / "ray"
    convert(tree, here, ConvertOptions(maxcount=8, seed=4))
    assert main(["convert", str(tree), str(there), "--ray", "--maxcount", "8", "--seed", "4"]) == 0
    out = capsys.readouterr().out
    assert "train: 120 samples in 15 shards (class folders)" in out
    assert "written by Ray tasks on 1 node: " in out and " (22)" in out  # 15 train + 7 val shards
    same_dataset(here, there)

    more = tmp_path / "more" / "train" / "n90000004"
    more.mkdir(parents=True)
    for i, source in enumerate(sorted((tree / "train" / "n90000005").glob("*.JPEG"))):
        more.joinpath(f"again_{i}.JPEG").write_bytes(source.read_bytes() + b"new")  # new bytes: an append refuses old
    append(tmp_path / "more", here, ConvertOptions())
    assert main(["convert", str(tmp_path / "more"), str(there), "--ray", "--append"]) == 0
    assert "appended 12 train samples in 2 new shards as version 2" in capsys.readouterr().out
    same_dataset(here, there)
    assert main(["convert", str(tmp_path / "more"), str(there), "--ray", "--append"]) == 1
    assert (
        f"raywds: error: 12 of the 12 images of {tmp_path / 'more'} are in {there} already" in capsys.readouterr().err
    )
    same_dataset(here, there)


def test_an_unreadable_image_under_strict_is_the_tasks_one_line_not_retried(
    tree: Path, tmp_path: Path, local_ray: None, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    broken = tmp_path / "tree"
    shutil.copytree(tree, broken)
    victim = sorted((broken / "train" / "n90000003").glob("*.JPEG"))[0]
    victim.write_bytes(victim.read_bytes()[:200])  # truncated
    assert main(["convert", str(broken), str(tmp_path / "out"), "--ray", "--strict"]) == 1
    err = capsys.readouterr().err
    assert f"raywds: error: {victim}: not a readable image" in err and "without --strict it would be skipped" in err
    assert "Traceback" not in err and not (tmp_path / "out" / "manifest.json").exists()


KEEPS = "run the same command again: it keeps every shard written so far"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["timeout -s INT", "timeout -s TERM"])
def test_a_driver_stopped_through_timeout_says_so_in_one_line_and_the_rerun_keeps_its_shards(
    signum: int, tree: Path, tmp_path: Path, local_ray: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """`timeout` signals the driver and then its process group, while the driver's tasks write
    shards on the cluster: one line and 128 + the signal's number, not Ray's Check failure from a
    cancel crossing a task's reply (SIGINT) nor its core worker's stack and abort (SIGTERM); the
    run again keeps what was journalled and ends with the local converter's shards."""
    import ray

    here, there = tmp_path / "local", tmp_path / "ray"
    convert(tree, here, ConvertOptions(maxcount=2, seed=4))
    args = ["convert", str(tree), str(there), "--ray", "--maxcount", "2", "--seed", "4"]  # 85 shards
    address = ray.get_runtime_context().gcs_address  # this process's cluster (its token is in os.environ)
    name = signal.Signals(signum).name
    run = subprocess.Popen(
        ["timeout", "--preserve-status", "-s", name[3:], "600", *RAYWDS, *args, "--address", address],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(journalled(there)) < 2 and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(run.pid, signal.SIGALRM)  # timeout's time is up: its signal to the driver, then to the group
        err = run.communicate(timeout=60)[1]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 128 + signum, f"it finished before it was stopped:\n{err[-3000:]}"
    assert [line for line in err.splitlines() if "INFO worker.py" not in line] == [
        f"raywds: error: convert stopped on {name}: {KEEPS}"
    ], err[-3000:]
    kept = journalled(there)
    assert 2 <= len(kept) < 85
    assert main(args) == 0
    assert f"kept {len(kept)} finished shards from an earlier run" in capsys.readouterr().out
    same_dataset(here, there)


def private_cluster(ray_temp: Path, **extra: str) -> dict[str, str]:
    """This process's environment (with the test bucket's AWS variables) for a CLI that starts a
    private local cluster, its token in `ray_temp`."""
    token = ray_temp / "auth_token"
    env = token_env(token if token.exists() else write_token(ray_temp))
    env.update(RAY_ADDRESS="local", RAY_TMPDIR=str(ray_temp), PYTHONUNBUFFERED="1", **extra)
    return env


def journalled(staging: Path) -> list[str]:
    path = staging / JOURNAL
    return [json.loads(line)["shard"]["name"] for line in path.read_text().splitlines()] if path.is_file() else []


def test_from_a_bucket_into_a_bucket_stopped_and_run_again_writes_every_shard_once(
    s3: S3Server, tree: Path, tmp_path: Path, ray_temp: Path
) -> None:
    """The tree in one prefix, the shards into another; the driver is interrupted (SIGINT, as
    Ctrl-C) once a few shards are journalled: no manifest is in the bucket then, and the run
    again keeps each journalled shard (its object not put again) and writes the rest; the
    result is the local converter's shards."""
    client = s3.client()
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        client.upload_file(str(path), s3.bucket, f"images/{path.relative_to(tree).as_posix()}")
    staging = tmp_path / "staging"
    args = [*RAYWDS, "convert", s3.url("images"), s3.url("ds"), "--ray", "--maxcount", "8", "--staging", str(staging)]
    slow = planted_slowness.environment(shard_s=0.4)  # each task's shard 0.4 s later: time to stop it midway
    first = subprocess.Popen(
        args, env=private_cluster(ray_temp, **slow), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while len(journalled(staging)) < 4 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    first.send_signal(signal.SIGINT)
    output = first.communicate(timeout=60)[0]
    assert first.returncode == 130, f"it finished before it was stopped:\n{output[-3000:]}"
    assert output.splitlines()[-1] == f"raywds: error: convert stopped on SIGINT: {KEEPS}", output[-3000:]
    kept = journalled(staging)
    assert 4 <= len(kept) < 22, output[-3000:]
    listed = client.list_objects_v2(Bucket=s3.bucket, Prefix="ds/").get("Contents", [])
    assert "ds/manifest.json" not in {o["Key"] for o in listed}, "a half-done conversion has no manifest"
    stamps = {o["Key"]: o["LastModified"] for o in listed}

    time.sleep(1.1)  # a shard put again would have a later LastModified (whole seconds)
    second = subprocess.run(args, env=private_cluster(ray_temp), capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"kept {len(kept)} finished shards from an earlier run" in second.stdout
    for name in kept:
        head = client.head_object(Bucket=s3.bucket, Key=f"ds/{name}")
        assert head["LastModified"] == stamps[f"ds/{name}"], f"{name} was put twice"

    here = tmp_path / "here"
    convert(tree, here, ConvertOptions(maxcount=8))
    there = tmp_path / "there"
    there.mkdir()
    for obj in client.list_objects_v2(Bucket=s3.bucket, Prefix="ds/")["Contents"]:
        client.download_file(s3.bucket, obj["Key"], str(there / obj["Key"][3:]))
    same_dataset(here, there)
    assert os.path.exists(there / "manifest.npz") and (there / "_info.json").is_file()
