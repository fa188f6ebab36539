"""Notices (raywds.train.notice): SIGTERM or SIGINT to a run's processes, as clusters send them
(to one rank, to the process group, through `timeout`, to every process of a torchrun job as
Slurm's scancel does), checkpoints every rank inside the epoch, stops each with one line and 128 +
the signal's number, and the resume is exact; the loader workers ignore what their rank handles;
a second signal a second later goes to the CLI at once; a run killed without notice counts the
steps it trains again (`steps_redone`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from support.data import epoch_keys, tar_keys
from support.planted import planted_slowness
from support.runs import small_config

from raywds.data.manifest import read_manifest
from raywds.loader.loader import val_loader
from raywds.loader.pool import Pool
from raywds.train import notice
from raywds.train.notice import Signals
from raywds.world import World

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
        "--batch-size", "4", "--image-size", "24", "--loader-workers", "2", "--audit-dir", str(audit),
        "--out", str(out), "--notice-every", "2", *more,
    ]  # fmt: skip


def wait_for_step(out: Path, step: int, process: subprocess.Popen[str], within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while last_step(out) < step:
        assert process.poll() is None, "".join(o for o in process.communicate() if o)[-3000:]
        assert time.monotonic() < deadline, f"no step {step} within {within_s} s"
        time.sleep(0.05)


def stopped_at(out: Path, reason: str, count: int = 1) -> int:
    """The step of the run's `count`-th checkpoint, the last, taken on a notice of `reason`,
    where the run trained no further step."""
    checkpoints = [r for r in rows(out) if r["kind"] == "checkpoint"]
    assert len(checkpoints) == count and checkpoints[-1]["reason"] == reason, checkpoints
    step = checkpoints[-1]["step"]
    assert step % 2 == 0 and last_step(out) == step, "no step trained past the checkpoint"
    return int(step)


def test_a_signal_is_one_notice_and_a_second_a_second_later_goes_to_the_handler_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGINT then SIGTERM at once (`timeout` signals its command, then the command's group) is
    one notice, of the first; a signal SAME_DELIVERY_S later goes to what handled it before
    (here Python's KeyboardInterrupt, under the CLI its one line), and from then on."""
    monkeypatch.setattr(notice, "SAME_DELIVERY_S", 0.2)
    # Python's own SIGINT handler, as in a foreground process: a shell without job control starts
    # background commands with SIGINT ignored, which Signals then leaves alone (as nohup's).
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    notices = Signals(World())
    try:
        assert notices() is None
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        got = notices()
        assert got is not None and (got.reason, got.signum, got.row()["reason"]) == ("sigint", 2, "sigint")
        stop = got.stopped("at step 4")
        assert (str(stop), stop.exit_code) == ("stopped on SIGINT at step 4", 130)
        time.sleep(0.25)
        with pytest.raises(KeyboardInterrupt) as second:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs at once
        assert second.value.__notes__ == [
            "a second signal ends the run at once, without a checkpoint: resume from its last one"
        ]
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before, "given back"
    finally:
        notices.close()
        signal.signal(signal.SIGINT, outer)


def ignored(pid: int) -> set[int]:
    """The signals process `pid` ignores (its SigIgn mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return {n for n in range(1, 64) if mask >> (n - 1) & 1}


def test_the_loader_workers_of_a_rank_that_takes_signals_ignore_them_and_go_on(shards: Path) -> None:
    """Sent to the whole group, SIGTERM and SIGINT reach the workers too: they ignore what their
    rank handles (the rank acts on it and ends them), and the next pass is made by them."""
    manifest = read_manifest(str(shards))
    cfg = small_config(shards, mode="split", batch_size=8, image_size=24, loader_workers=2).loader()
    notices = Signals(World())
    pool = Pool(World(), timeout=60)
    try:
        pool.warm(2)
        pids = [pid for pid in pool.pids if pid is not None]
        deadline = time.monotonic() + 30
        while not all({signal.SIGTERM, signal.SIGINT} <= ignored(pid) for pid in pids):
            assert time.monotonic() < deadline, [sorted(ignored(pid)) for pid in pids]
            time.sleep(0.05)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        samples = sum(len(b.ids) for b in val_loader(manifest, cfg, World(), pool=pool))
        assert samples == manifest.num_samples("val") and pool.pids == pids and pool.replaced == 0
        assert notices() is None, "the workers' signals are not the rank's"
    finally:
        pool.close()
        notices.close()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)


def to_the_group(run: subprocess.Popen[str], signum: int) -> None:
    os.killpg(run.pid, signum)  # `kill -- -PGID`, systemd's stop (KillMode=control-group), Ctrl-C (SIGINT)


def timing_out(run: subprocess.Popen[str], signum: int) -> None:
    os.kill(run.pid, signal.SIGALRM)  # `timeout`'s time is up: its signal to the command, then to the group


DELIVERIES: dict[str, tuple[int, Callable[[subprocess.Popen[str], int], None], bool]] = {
    "SIGINT to the group (Ctrl-C), resumed": (signal.SIGINT, to_the_group, True),
    "timeout -s TERM (the command, then its group)": (signal.SIGTERM, timing_out, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("delivery", list(DELIVERIES))
def test_a_signal_to_every_process_of_a_run_checkpoints_and_stops_it_in_one_line(
    delivery: str, uneven: Path, tmp_path: Path
) -> None:
    """A run with two loader workers, in a process group of its own, signalled as a cluster or a
    terminal does it: the notice's checkpoint inside the epoch, exit 128 + the signal's number,
    one line on stderr; the resume trains no step again."""
    signum, deliver, resumed = DELIVERIES[delivery]
    out, audit = tmp_path / "run", tmp_path / "audit"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **planted_slowness.environment(0.15)}  # steps of 0.15 s
    line = [sys.executable, *train_line(uneven, out, audit, "--epochs", "1")]
    if deliver is timing_out:
        line = ["timeout", "--preserve-status", "-s", "TERM", "600", *line]
    run = subprocess.Popen(
        line, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        wait_for_step(out, 3, run)
        deliver(run, signum)
        err = run.communicate(timeout=60)[1]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    name = signal.Signals(signum).name
    assert run.returncode == 128 + signum, err[-3000:]
    step = stopped_at(out, name.lower())
    assert err.splitlines() == [
        f"raywds: error: stopped on {name} at step {step}, inside epoch 1, after a checkpoint: "
        f"resume with --resume {out / 'checkpoint.pt'}"
    ]
    if resumed:
        again = subprocess.run(
            [sys.executable, *train_line(uneven, out, audit, "--epochs", "1", "--resume", str(out / "checkpoint.pt"))],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert epoch_keys(audit, 0, uneven) == Counter(tar_keys(uneven)), (
            "the stopped epoch and its rest: every sample once"
        )
        assert [r["steps_redone"] for r in rows(out) if r["kind"] == "epoch"] == [0]


def every_process(run: subprocess.Popen[str]) -> list[psutil.Process]:
    """torchrun's agent and all it started: its ranks, their fork servers and loader workers."""
    agent = psutil.Process(run.pid)
    return [agent, *agent.children(recursive=True)]


@pytest.mark.slow
def test_sigterm_to_one_torchrun_rank_then_to_every_process_checkpoints_every_rank_and_the_resumes_are_exact(
    uneven: Path, tmp_path: Path
) -> None:
    """SIGTERM to one rank (as a pod's or a VM's shutdown might), then, to the resumed run, SIGTERM
    to every process of it at once, as Slurm's scancel sends it (each rank gets it twice: from
    Slurm and from torchrun's agent, which passes it on to each rank's process group, loader
    workers included): each time every rank checkpoints inside the epoch and stops within the
    grace period; the last resume finishes, every sample once per epoch, no step trained again."""
    out, audit = tmp_path / "run", tmp_path / "audit"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **planted_slowness.environment(0.15)}  # steps of 0.15 s
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    resume = ("--resume", str(out / "checkpoint.pt"))
    stopped = 0
    for signalled, more in (("one rank", ()), ("every process", resume)):
        run = subprocess.Popen(
            [*torchrun, *train_line(uneven, out, audit, *more)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_for_step(out, stopped + (3 if signalled == "one rank" else 1), run)
            ranks = [p for p in psutil.Process(run.pid).children() if "raywds" in " ".join(p.cmdline())]
            assert len(ranks) == 2
            for process in [ranks[1]] if signalled == "one rank" else every_process(run):
                process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            output = run.communicate(timeout=60)[0]
            took = time.monotonic() - sent
        finally:
            run.kill()
        lines = [line for line in output.splitlines() if line.startswith("raywds: error: ")]
        assert run.returncode != 0 and len(lines) == 2, output[-3000:]  # one a rank
        assert all("stopped on SIGTERM at step" in line for line in lines), output[-3000:]
        assert took < 30, f"every rank stopped {took:.0f} s after the SIGTERM: past Kubernetes' default grace period"
        stopped = stopped_at(out, "sigterm", count=1 if signalled == "one rank" else 2)

    resumed = subprocess.run(
        [*torchrun, *train_line(uneven, out, audit, *resume)],
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
