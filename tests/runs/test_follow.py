"""raywds.runs.follow draws a run's progress bar from the rows a test appends to metrics.jsonl, as
rank 0 of a run would: no Ray, no training."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raywds.runs.follow import Follower, follow


def append(run_dir: Path, *rows: dict[str, Any], end: str = "\n") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + end)


def progress_row(epoch: int, step: int, steps: int) -> dict[str, Any]:
    """The row raywds.train.progress.ProgressLog appends inside an epoch."""
    return {"kind": "progress", "epoch": epoch, "step_in_epoch": step, "steps_in_epoch": steps, "loss": 1.5}


def epoch_row(epoch: int, step: int) -> dict[str, Any]:
    return {"kind": "epoch", "epoch": epoch, "step": step, "train_loss": 0.5, "val_top1": 0.75}


def wait_until(check: Callable[[], bool], follower: Follower, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"bar at {follower.bar.n}/{follower.bar.total}"
        time.sleep(0.01)


def read_twice(follower: Follower) -> None:
    """Until the follower has read the file twice more: whatever it had to see, it saw (a sleep
    instead passed without a read at all on a slow machine, and could not fail)."""
    first = follower.polls
    wait_until(lambda: follower.polls >= first + 2, follower)


def test_the_bar_follows_progress_and_epoch_rows_to_the_end(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", io.StringIO()
    with follow(run_dir, epochs=2, poll_s=0.01, file=out) as follower:
        bar = follower.bar
        read_twice(follower)  # no folder yet: the bar waits
        assert (bar.n, bar.total) == (0, None)
        append(run_dir, progress_row(1, 5, 10))
        wait_until(lambda: (bar.n, bar.total) == (5, 20), follower)
        append(run_dir, epoch_row(1, 10), progress_row(2, 4, 10))
        wait_until(lambda: bar.n == 14, follower)
        append(run_dir, progress_row(2, 9, 10), end="")  # half written: not read until its newline
        read_twice(follower)
        assert bar.n == 14
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write("\n")
        wait_until(lambda: bar.n == 19, follower)
        append(run_dir, epoch_row(2, 20))
        wait_until(lambda: bar.n == 20, follower)
    assert not follower._thread.is_alive()
    assert (bar.n, bar.total) == (20, 20)
    assert "20/20" in out.getvalue() and "epoch 2/2 done  loss 0.500  top-1 0.750" in out.getvalue()


def test_rows_written_before_the_bar_and_after_its_thread_stopped_are_counted(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    append(run_dir, progress_row(1, 3, 8))
    with follow(run_dir, epochs=3, poll_s=60, file=io.StringIO()) as follower:
        append(run_dir, epoch_row(1, 8), epoch_row(2, 16))  # the thread sleeps: read when the block ends
    assert (follower.bar.n, follower.bar.total) == (16, 24)


def test_the_total_comes_from_the_run_folders_config_and_max_steps(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "raywds-config.json").write_text(json.dumps({"train": {"epochs": 6}, "run": {"max_steps": 15}}))
    with follow(run_dir, poll_s=0.01, file=io.StringIO()) as follower:
        append(run_dir, epoch_row(1, 10))
        wait_until(lambda: follower.bar.total == 15, follower)  # 6 epochs of 10 steps, cut at max_steps
        append(run_dir, {"kind": "checkpoint", "epoch": 1, "step": 15, "inside_epoch": True})
        wait_until(lambda: follower.bar.n == 15, follower)


def test_a_rewritten_file_starts_the_count_over_and_odd_rows_are_skipped(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with follow(run_dir, epochs=1, poll_s=0.01, file=io.StringIO()) as follower:
        append(run_dir, progress_row(1, 7, 10), progress_row(1, 8, 10))
        wait_until(lambda: follower.bar.n == 8, follower)
        (run_dir / "metrics.jsonl").write_text("")  # a new local run in the same folder truncates it
        append(run_dir, {"kind": "progress", "epoch": 1}, progress_row(1, 2, 10))  # no step: skipped
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write("not json\n")
        append(run_dir, progress_row(1, 3, 10))
        wait_until(lambda: follower.bar.n == 3, follower)
