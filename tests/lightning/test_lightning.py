"""raywds.lightning: the DataModule under Lightning's own Trainer, on 2 gloo ranks started by
torchrun, through the example (examples/lightning_imagenet.py) as a user runs it."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from support.runs import small_config

from raywds.data.manifest import read_manifest
from raywds.plan.modes import epoch_plan
from raywds.train.audit import audit

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="no lightning (its extra)"),
]  # found, not imported: collecting this file imports no Lightning

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_imagenet.py"
FLAGS = ["--model", "demo", "--optimizer", "adamw", "--lr", "0.003", "--image-size", "28", "--loader-workers", "1"]


def run(data: Path, out: Path, *flags: str, ranks: int = 2, timeout: float = 480, small: bool = True) -> str:
    """The example on `ranks` gloo processes (torchrun), or one, with the tests' small model and
    crops unless not `small`; its output, after it exited 0."""
    with started(command(data, out, *flags, ranks=ranks, small=small), out.parent, capture=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the example ran past {timeout} s: {shlex.join(process.args)}")  # type: ignore[arg-type]
    assert process.returncode == 0, output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    return output


@contextlib.contextmanager
def started(line: list[str], cwd: Path, capture: bool = False) -> Iterator[subprocess.Popen[str]]:
    """`line` running; on the way out, it and every process under it (torchrun's ranks, their
    loader workers and fork servers) killed by PID: killing torchrun alone leaves its ranks running."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    output = subprocess.PIPE if capture else subprocess.DEVNULL
    process = subprocess.Popen(line, env=env, cwd=cwd, stdout=output, stderr=subprocess.STDOUT, text=True)
    try:
        yield process
    finally:
        kill_tree(process.pid)
        process.wait(timeout=30)


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(tree, timeout=30)


def command(data: Path, out: Path, *flags: str, ranks: int = 2, small: bool = True) -> list[str]:
    launcher = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={ranks}"]
    line = [*(launcher if ranks > 1 else [sys.executable]), str(EXAMPLE)]
    line += ["--data", str(data), "--out", str(out), "--devices", str(ranks), "--accelerator", "cpu"]
    return [*line, *(FLAGS if small else []), *flags]


def test_resample_epochs_give_both_ranks_the_same_batches(shards: Path, tmp_path: Path) -> None:
    run(shards, tmp_path / "run", "--mode", "resample", "--epochs", "1", "--batch-size", "16",
        "--audit-dir", str(tmp_path / "audit"))  # fmt: skip
    per_rank = {f.name.split("-")[1]: len(f.read_bytes()) // 8 for f in (tmp_path / "audit").glob("*.ids")}
    assert per_rank == {"rank00000": 64, "rank00001": 64}, per_rank  # ceil(120 / 32) = 4 batches of 16 each


KILLED_FLAGS = ["--mode", "split", "--batch-size", "4", "--epochs", "2", "--checkpoint-every-steps", "3"]


@pytest.fixture(scope="module")
def killed(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run on two ranks, a checkpoint every 3 steps, killed (SIGKILL to torchrun, the ranks and
    their loader workers) once a step after a checkpoint has trained: its folder, with the run's
    output in run/ and its audit files in audit/. Each resume below starts from a copy of it, so
    both resume the same killed state, and the killed run (about 30 s) runs once, not twice.

    Its split epochs deal the ranks 64 and 56 samples, 16 and 14 batches of 4 (checked from the
    plan): the rank that runs out first must join the other, or both hang."""
    cfg = small_config(shards, mode="split", batch_size=4)
    counts = [epoch_plan(read_manifest(str(shards)), cfg, 2, epoch=e).batches_per_rank for e in range(2)]
    assert all(a != b for a, b in counts), counts
    folder = tmp_path_factory.mktemp("killed")
    audit_dir, out = folder / "audit", folder / "run"
    line = command(shards, out, *KILLED_FLAGS, "--audit-dir", str(audit_dir))
    after_checkpoint = re.compile(r"-at(\d+)-")
    with started(line, folder) as first:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and first.poll() is None:
            trained_after = [
                f for f in audit_dir.glob("*.ids") if int(after_checkpoint.search(f.name)[1]) > 0 and f.stat().st_size
            ]  # fmt: skip
            if trained_after and (out / "last.ckpt").is_file():
                break
            time.sleep(0.02)
        ended_itself = first.poll() is not None
    assert not ended_itself, "the run ended before a step after a checkpoint: nothing was killed"
    return folder


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_run_killed_mid_epoch_resumes_from_its_lightning_checkpoint_exactly(
    shards: Path, killed: Path, tmp_path: Path, ranks: int
) -> None:
    """The killed run (`killed`) resumed from last.ckpt with Trainer.fit(ckpt_path=...) on 2 ranks
    and on 1, each from its own copy. What the killed run trained after its checkpoint is redone
    (the audit files keep it apart); no hang on the uneven batches, every epoch exact, and
    validation over every val sample once an epoch."""
    shutil.copytree(killed, tmp_path, dirs_exist_ok=True)
    audit_dir, out = tmp_path / "audit", tmp_path / "run"
    output = run(
        shards, out, *KILLED_FLAGS, "--audit-dir", str(audit_dir), "--resume", str(out / "last.ckpt"), ranks=ranks
    )
    assert re.findall(r"^epoch (\d)/2  samples 120 .* val samples 50", output, re.M) == ["1", "2"], output[-3000:]
    assert re.search(r"^epochs 2  top-1 [\d.]+  top-5 [\d.]+  samples seen 240  images/s", output, re.M), output[-2000:]
    every = Counter(i for f in audit_dir.glob("*.ids") for i in np.fromfile(f, dtype="<i8").tolist())
    assert max(every.values()) > 1, "the killed run trained nothing after its checkpoint, so nothing was redone"
    checks = audit(audit_dir, read_manifest(str(shards)))
    assert [c.line for c in checks] == ["epoch 1: 120 samples, each once", "epoch 2: 120 samples, each once"]


def test_the_example_reaches_the_demos_accuracy_in_two_epochs(demo: Path, tmp_path: Path) -> None:
    """The demo recipe (its model, 56 px crops, AdamW) in one process, 2 of its 6 epochs, as
    `raywds train --demo --epochs 2` runs it: top-1 above 0.9 on the 300 val images."""
    out = run(demo, tmp_path / "run", "--recipe", "demo", "--epochs", "2", ranks=1, small=False)
    line = re.search(r"^epochs 2  top-1 ([\d.]+)  top-5 [\d.]+  samples seen (\d+)  images/s", out, re.M)
    # resample: ceil(1200 / 32) = 38 batches of 32 an epoch
    assert line and float(line[1]) > 0.9 and int(line[2]) == 2 * 38 * 32, out[-2000:]
