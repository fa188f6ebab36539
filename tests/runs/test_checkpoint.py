"""A run folder that others can write, a full disk and a power cut: checkpoints that hold code
are refused, damaged or unwritable ones are one line, a run folder takes one run at a time,
and a checkpoint reaches the disk before its name does."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.runs import small_config

from raywds.errors import ConfigError, StorageError
from raywds.launch.local import run_local
from raywds.runs.checkpoint import load_checkpoint, save_checkpoint
from raywds.runs.files import LOCK as LOCK_FILE
from raywds.runs.folder import RunDir
from raywds.runs.lock import RunLock
from raywds.train.trainer import train
from raywds.world import World


class Planted:
    """What a checkpoint on shared storage may hold when someone else wrote it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_naming_file_and_type(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    torch.save({"model": {"w": torch.zeros(2)}, "epoch": 0, "extra": Planted(marker)}, tmp_path / "checkpoint.pt")
    with pytest.raises(
        StorageError,
        match=rf"^checkpoint {tmp_path}/checkpoint.pt holds a posix.system, which raywds's checkpoints never",
    ):
        load_checkpoint(str(tmp_path))
    assert not marker.exists(), "the planted call ran"


def test_a_resumed_split_run_loads_its_checkpoint_as_weights_only(shards: Path, tmp_path: Path) -> None:
    """A checkpoint inside a split epoch holds the most: the data position's per-shard counts and
    the flags of the shards in flight (bytes); it resumes to train exactly what is left."""
    cfg = small_config(shards, mode="split", batch_size=8, epochs=1, max_steps=3, out=str(tmp_path))
    train(cfg, World(), run_dir=RunDir(tmp_path))
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    position = state["progress"]["position"]
    assert isinstance(position["shards_done"], bytes) and len(position["shards_done"]) == 8 * 8  # int64 per shard
    assert position["partial"] and all(isinstance(bits, bytes) for _, bits in position["partial"].values())
    final = train(dataclasses.replace(cfg, max_steps=None, resume=str(tmp_path), out=str(tmp_path / "r")), World())
    assert final["epoch"] == 1 and (final["epoch_samples"], final["train_samples"]) == (120, 96)


def test_resuming_a_finished_run_says_how_to_train_more(shards: Path, tmp_path: Path) -> None:
    cfg = small_config(shards, epochs=1, batches_per_epoch=2, out=str(tmp_path))
    train(cfg, World(), run_dir=RunDir(tmp_path))
    with pytest.raises(
        ConfigError,
        match=r"has already trained 1 epochs, and --epochs is 1: nothing is left to train; "
        r".* larger --epochs \(e\.g\. --epochs 2\)",
    ):
        train(dataclasses.replace(cfg, resume=str(tmp_path)), World())


def test_a_truncated_checkpoint_is_one_line_naming_an_earlier_one(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(10000.0)}, "epoch": 1}
    save_checkpoint(state, tmp_path / "checkpoint.pt")
    (tmp_path / "best").mkdir()
    save_checkpoint(state, tmp_path / "best" / "checkpoint.pt")
    whole = (tmp_path / "checkpoint.pt").read_bytes()
    (tmp_path / "checkpoint.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(
        StorageError,
        match=rf"^checkpoint {tmp_path}/checkpoint.pt is damaged \(.*\); an earlier checkpoint of this run is "
        rf"{tmp_path}/best/checkpoint.pt: --resume {tmp_path}/best$",
    ):
        load_checkpoint(str(tmp_path))
    os.truncate(tmp_path / "best" / "checkpoint.pt", 0)
    with pytest.raises(StorageError, match="is damaged .* no other checkpoint of this run was found beside it"):
        load_checkpoint(str(tmp_path / "best"))


def test_a_damaged_ray_checkpoint_names_the_newest_other_one(tmp_path: Path) -> None:
    state = {"model": {"w": torch.zeros(10)}, "epoch": 1}
    for name in ("checkpoint_2026-01-01_00-00-01", "checkpoint_2026-01-01_00-00-02", "best"):
        (tmp_path / name).mkdir()
        save_checkpoint(state, tmp_path / name / "checkpoint.pt")
    damaged = tmp_path / "checkpoint_2026-01-01_00-00-02"
    os.truncate(damaged / "checkpoint.pt", 100)
    with pytest.raises(
        StorageError, match=rf"an earlier checkpoint of this run is {tmp_path}/checkpoint_2026-01-01_00-00-01/"
    ):
        load_checkpoint(str(damaged))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1.2 MB tmpfs, unmounted after the test."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)  # lazy: a file left open does not keep it


def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(small_disk: Path) -> None:
    path = small_disk / "checkpoint.pt"
    save_checkpoint({"model": {"w": torch.zeros(100_000)}, "epoch": 1}, path)  # 400 kB
    with pytest.raises(
        StorageError,
        match=rf"^cannot write checkpoint {path}: no space left on its disk \(it needs \d+ bytes, \d+ are free\); "
        "the previous checkpoint.pt there is kept; free some space or give another --out$",
    ):
        save_checkpoint({"model": {"w": torch.zeros(250_000)}, "epoch": 2}, path)  # 1 MB
    assert load_checkpoint(str(path))["epoch"] == 1
    assert [p.name for p in small_disk.iterdir()] == ["checkpoint.pt"], "the partial file is removed"


def test_a_checkpoint_and_its_folder_reach_the_disk_before_the_name_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What os.fsync was called on, and whether the rename had happened yet (the real fsync runs)."""
    synced: list[tuple[str, bool]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), (tmp_path / "checkpoint.pt").exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_checkpoint({"model": {}, "epoch": 1}, tmp_path / "checkpoint.pt")
    assert synced == [(str(tmp_path / "checkpoint.pt.tmp"), False), (str(tmp_path), True)]


def hold(folder: Path, then: str) -> list[str]:
    """A Python command line that takes the lock on `folder`, prints its PID, then runs `then`."""
    take = f"import os, sys; from raywds.runs.lock import RunLock; lock = RunLock({str(folder)!r}).acquire()"
    return [sys.executable, "-c", f"{take}; print(os.getpid(), flush=True); {then}"]


def test_a_run_folder_takes_one_run_at_a_time(tmp_path: Path) -> None:
    with RunLock(tmp_path):
        with pytest.raises(
            StorageError,
            match=rf"^run folder {tmp_path} is in use by process {os.getpid()} on \S+: wait for that run to end, "
            "or give this one another --out$",
        ):
            RunLock(tmp_path).acquire()
    with RunLock(tmp_path):  # released, so taken again without a word
        pass
    assert (tmp_path / LOCK_FILE).read_text() == ""


def test_a_lock_whose_process_is_gone_is_taken_over_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    killed = subprocess.run(hold(tmp_path, "os._exit(9)"), capture_output=True, text=True, check=False)
    pid = killed.stdout.strip()
    assert killed.returncode == 9 and pid, killed.stderr
    with caplog.at_level(logging.WARNING, logger="raywds.runs.lock"), RunLock(tmp_path):
        assert f"process {os.getpid()} on" in (tmp_path / LOCK_FILE).read_text()
    assert f"run folder {tmp_path}: taking over the lock of process {pid} on" in caplog.text


def test_a_second_local_run_into_a_held_folder_is_refused_before_it_writes(shards: Path, tmp_path: Path) -> None:
    holder = subprocess.Popen(
        hold(tmp_path, "sys.stdin.read()"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == f"{holder.pid}\n"
        with pytest.raises(StorageError, match=rf"^run folder {tmp_path} is in use by process {holder.pid} on "):
            run_local(small_config(shards, epochs=1, out=str(tmp_path)))
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE], "the second run wrote nothing"
    finally:
        holder.communicate("")
    metrics, _ = run_local(small_config(shards, epochs=1, batches_per_epoch=1, out=str(tmp_path)))
    assert metrics["epoch"] == 1, "once the first run is over, the folder is free"
