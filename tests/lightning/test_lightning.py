"""raywds.lightning: the DataModule under Lightning's own Trainer, on 2 gloo ranks started by
torchrun, through the example (examples/lightning_imagenet.py) as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import UNEVEN_SIZES, epoch_keys, small_config, tar_keys

from raywds.data.manifest import read_manifest
from raywds.plan.modes import epoch_plan
from raywds.train.audit import audit

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_imagenet.py"
FLAGS = ["--model", "demo", "--optimizer", "adamw", "--lr", "0.003", "--image-size", "28", "--loader-workers", "1"]


def run(data: Path, out: Path, *flags: str, ranks: int = 2, timeout: float = 300, small: bool = True) -> str:
    """The example on `ranks` gloo processes (torchrun), or one, with the tests' small model and
    crops unless not `small`; its output, after it exited 0."""
    launcher = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={ranks}"]
    command = [*(launcher if ranks > 1 else [sys.executable]), str(EXAMPLE)]
    command += ["--data", str(data), "--out", str(out), "--devices", str(ranks), "--accelerator", "cpu"]
    command += [*(FLAGS if small else []), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=out.parent)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    return output


def test_split_epochs_on_two_ranks_with_uneven_batches_train_every_sample_once(shards: Path, tmp_path: Path) -> None:
    """64 and 56 samples a rank, 8 and 7 batches of 8 (checked from the plan): the rank that runs
    out first must join the other, or both hang. No hang, every sample once an epoch, and
    validation over every val sample once."""
    cfg = small_config(shards, mode="split", batch_size_per_rank=8)
    counts = [epoch_plan(read_manifest(str(shards)), cfg, 2, epoch=e).batches_per_rank for e in range(2)]
    assert all(a != b for a, b in counts), counts
    out = run(shards, tmp_path / "run", "--mode", "split", "--epochs", "2", "--batch-size", "8",
              "--audit-dir", str(tmp_path / "audit"))  # fmt: skip
    for e in range(2):
        assert epoch_keys(tmp_path / "audit", e, shards) == Counter(tar_keys(shards)), f"epoch {e + 1}"
    assert re.findall(r"epoch (\d)/2  samples 120 .* val samples 50", out) == ["1", "2"], out[-3000:]
    assert re.search(r"^epochs 2  top-1 [\d.]+  top-5 [\d.]+  samples seen 240  images/s", out, re.M), out[-2000:]


def test_resample_epochs_give_both_ranks_the_same_batches(shards: Path, tmp_path: Path) -> None:
    run(shards, tmp_path / "run", "--mode", "resample", "--epochs", "1", "--batch-size", "16",
        "--audit-dir", str(tmp_path / "audit"))  # fmt: skip
    per_rank = {f.name.split("-")[1]: len(f.read_bytes()) // 8 for f in (tmp_path / "audit").glob("*.ids")}
    assert per_rank == {"rank00000": 64, "rank00001": 64}, per_rank  # ceil(120 / 32) = 4 batches of 16 each


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_run_stopped_mid_epoch_resumes_from_its_lightning_checkpoint_exactly(
    uneven: Path, tmp_path: Path, ranks: int
) -> None:
    """Stopped at step 3 of the first epoch (a checkpoint there), then resumed from that
    checkpoint with Trainer.fit(ckpt_path=...) on 2 ranks and on 1: both epochs exact."""
    audit_dir, out = tmp_path / "audit", tmp_path / "run"
    common = ["--mode", "split", "--batch-size", "8", "--audit-dir", str(audit_dir)]
    first = run(uneven, out, *common, "--epochs", "2", "--max-steps", "3", "--checkpoint-every-steps", "3")
    assert "stopped at step 3" in first, first[-2000:]
    assert (out / "last.ckpt").is_file()
    run(uneven, out, *common, "--epochs", "2", "--resume", str(out / "last.ckpt"), ranks=ranks)
    checks = audit(audit_dir, read_manifest(str(uneven)))
    assert [c.line for c in checks] == ["epoch 1: 120 samples, each once", "epoch 2: 120 samples, each once"]
    assert sum(UNEVEN_SIZES) == 120


def test_the_example_reaches_the_demos_accuracy_in_two_epochs(demo: Path, tmp_path: Path) -> None:
    """The demo recipe (its model, 56 px crops, AdamW) in one process, 2 of its 6 epochs, as
    `raywds train --demo --epochs 2` runs it: top-1 above 0.9 on the 300 val images."""
    out = run(demo, tmp_path / "run", "--recipe", "demo", "--epochs", "2", ranks=1, small=False)
    line = re.search(r"^epochs 2  top-1 ([\d.]+)  top-5 [\d.]+  samples seen (\d+)  images/s", out, re.M)
    # resample: ceil(1200 / 32) = 38 batches of 32 an epoch
    assert line and float(line[1]) > 0.9 and int(line[2]) == 2 * 38 * 32, out[-2000:]
