"""Notices (raywds.train.notice): SIGTERM to a torchrun rank mid-epoch checkpoints every rank
inside the epoch and stops them within the grace period, and the resume is exact; a run killed
without notice counts the steps it trains again (`steps_redone`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from support.data import epoch_keys, tar_keys
from support.planted import planted_slowness

BIN = Path(sys.executable).parent


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_step(out: Path) -> int:
    try:
        return int((out / "last-step").read_text())
    except (OSError, ValueError):
        return 0


def train_line(data: Path, out: Path, audit: Path, *more: str) -> list[str]:
    return [
        "-m", "raywds", "train", "--data", str(data), "--model", "demo", "--mode", "split", "--epochs", "2",
        "--batch-size", "4", "--image-size", "24", "--loader-workers", "1", "--audit-dir", str(audit),
        "--out", str(out), "--notice-every", "2", *more,
    ]  # fmt: skip


def wait_for_step(out: Path, step: int, process: subprocess.Popen[str], within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while last_step(out) < step:
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no step {step} within {within_s} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_to_one_torchrun_rank_checkpoints_every_rank_and_the_resume_is_exact(
    uneven: Path, tmp_path: Path
) -> None:
    out, audit = tmp_path / "run", tmp_path / "audit"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **planted_slowness.environment(0.15)}  # steps of 0.15 s
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    run = subprocess.Popen(
        [*torchrun, *train_line(uneven, out, audit)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_step(out, 3, run)
        ranks = [p for p in psutil.Process(run.pid).children() if "raywds" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        ranks[1].send_signal(signal.SIGTERM)  # one rank only, as a pod's or a VM's shutdown might
        sent = time.monotonic()
        output = run.communicate(timeout=60)[0]
        took = time.monotonic() - sent
    finally:
        run.kill()
    assert run.returncode != 0 and "stopped on SIGTERM at step" in output, output[-3000:]
    assert took < 30, f"every rank stopped {took:.0f} s after the SIGTERM: past Kubernetes' default grace period"
    checkpoint = [r for r in rows(out) if r["kind"] == "checkpoint"]
    assert len(checkpoint) == 1 and checkpoint[0]["reason"] == "sigterm" and checkpoint[0]["epoch"] == 0
    stopped_at = checkpoint[0]["step"]
    assert stopped_at % 2 == 0 and last_step(out) == stopped_at, "no step trained past the checkpoint"

    resumed = subprocess.run(
        [*torchrun, *train_line(uneven, out, audit, "--resume", str(out / "checkpoint.pt"))],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    everything = Counter(tar_keys(uneven))
    assert epoch_keys(audit, 0, uneven) == everything, "the stopped epoch and its rest: every sample once"
    assert epoch_keys(audit, 1, uneven) == everything
    epochs = [r for r in rows(out) if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and [r["steps_redone"] for r in epochs] == [0, 0]


@pytest.mark.slow
def test_a_run_killed_without_notice_counts_the_steps_it_trains_again(uneven: Path, tmp_path: Path) -> None:
    out, audit = tmp_path / "run", tmp_path / "audit"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **planted_slowness.environment(0.2)}
    line = [sys.executable, *train_line(uneven, out, audit, "--checkpoint-every-steps", "4", "--epochs", "1")]
    run = subprocess.Popen(line, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(out, 5, run)  # 3 steps of 0.2 s before the next checkpoint
        run.kill()  # a lost node: no notice
        run.wait()
    finally:
        run.kill()
    killed_at = last_step(out)
    checkpoint = [r for r in rows(out) if r["kind"] == "checkpoint"][-1]
    assert "reason" not in checkpoint and checkpoint["step"] < killed_at
    resumed = subprocess.run(
        [*line[:-2], "--epochs", "1", "--resume", str(out / "checkpoint.pt")],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    (epoch,) = [r for r in rows(out) if r["kind"] == "epoch"]
    assert epoch["steps_redone"] == killed_at - checkpoint["step"] > 0
