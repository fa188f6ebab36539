"""raywds.lightning's DataModule inside Ray Train's Lightning integration (RayDDPStrategy,
RayLightningEnvironment, RayTrainReportCallback), through the example's own `fit_on_ray`."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from support.runs import small_config

from raywds.data.manifest import read_manifest
from raywds.train.audit import audit

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="no lightning (its extra)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_imagenet.py"


def test_a_killed_worker_resumes_inside_the_epoch_and_every_epoch_stays_exact(
    shards: Path, tmp_path: Path, local_ray: None
) -> None:
    """2 Ray Train workers, split mode with 16 and 14 batches a rank, a checkpoint every 3 steps:
    rank 1 is killed (SIGKILL) once it has trained a step after a checkpoint; Ray restarts the
    group, which resumes from raywds's last.ckpt inside the epoch (newer than Ray's own, from no
    epoch's end yet). Every epoch exact (the audit keeps the redone steps apart), validation over
    all 50 samples, and Ray keeps the Lightning checkpoint each epoch's end reports."""
    from ray import cloudpickle

    spec = importlib.util.spec_from_file_location("lightning_imagenet", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = sys.modules["lightning_imagenet"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cloudpickle.register_pickle_by_value(example)  # the workers cannot import the example by name
    audit_dir = tmp_path / "audit"
    cfg = small_config(
        shards, mode="split", batch_size=4, epochs=2, checkpoint_every_steps=3,
        audit_dir=str(audit_dir), out=str(tmp_path / "run"),
    )  # fmt: skip
    killed: list[int] = []

    def kill_rank1_after_a_checkpoint() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            for f in audit_dir.glob("epoch0000-rank00001-*.ids"):
                if int(re.search(r"-at(\d+)-", f.name)[1]) > 0 and f.stat().st_size:  # type: ignore[index]
                    pid = int(f.name.rsplit("-pid", 1)[1].split(".")[0])
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_rank1_after_a_checkpoint, daemon=True)
    killer.start()
    result = example.fit_on_ray(cfg, 2, storage=str(tmp_path / "ray"))
    killer.join(timeout=5)
    assert killed, "rank 1 never trained a step after a checkpoint"
    resumed = {int(m[1]) for f in audit_dir.glob("*.ids") if (m := re.search(r"-from(\d+)-", f.name))}
    assert len(resumed) == 2 and min(resumed) == 0 and max(resumed) > 0, f"no resume inside the epoch: {resumed}"
    checks = audit(audit_dir, read_manifest(str(shards)))
    assert [c.line for c in checks] == ["epoch 1: 120 samples, each once", "epoch 2: 120 samples, each once"]
    assert result.metrics["val_samples"] == 50 and result.metrics["epoch"] == 1, result.metrics
    assert result.checkpoint is not None and Path(result.checkpoint.path).is_relative_to(tmp_path / "ray")
