"""`raywds ray --async-validation`: each epoch's checkpoint is validated in a Ray task of its own
while the ranks train on (Ray Train's ValidationConfig), instead of by the ranks between epochs.
The task scores the checkpoint as `raywds evaluate` does (raywds.infer.evaluation: every sample of
the val split once, with the crops, mean and std the run validates with) and keeps best/ in the
run folder, as in-loop validation does: it holds the checkpoint then, which Ray may remove once
validated. Rank 0 lands the numbers in the run's rows: a validation row for the epoch, which
`raywds.runs.rows.epochs` merges into its epoch row, logged to the tracking runs at that epoch's
step. Ray Train runs one validation at a time, in the order reported; rank 0 waits for those still
running when the ranks end, so the last epoch's numbers and best/ are there when the run returns.

    ValidationConfig = validation_config(resources, plan)   # the driver's, given to the TorchTrainer
    landing = Landing(run_dir); landing.land(wait=False)     # rank 0, after each report
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import ray.train

from raywds.infer.evaluation import Scoring, evaluate, validation_numbers
from raywds.launch.cluster import WorkerPlan
from raywds.launch.runstore import checkpoint_folder, open_run_dir
from raywds.models.trained import load_trained
from raywds.runs import files
from raywds.runs.checkpoint import load_checkpoint
from raywds.runs.folder import RunDir
from raywds.runs.rows import kind, validation_row
from raywds.train.config import TrainConfig
from raywds.world import World

log = logging.getLogger(__name__)

SECONDS = "validation_s"
"""The key of the task's own time among the numbers it returns."""


def task_resources(resources: dict[str, float], plan: WorkerPlan, held_cpus: float) -> dict[str, float]:
    """What one validation task reserves on a cluster of `resources`: a GPU where one is left beside
    the training workers', else a CPU where one is left beside the `held_cpus` that training holds
    (its workers, the Ray Data plane's decode tasks), else nothing: the task then shares the
    training workers' CPUs, which slows them while it runs but never waits behind them (a task
    that waited for a CPU the run holds would wait until the run ends, and the run for it)."""
    if plan.use_gpu and resources.get("GPU", 0) - plan.num_workers >= 1:
        return {"num_cpus": 1, "num_gpus": 1}
    if resources.get("CPU", 0) - held_cpus >= 1:
        return {"num_cpus": 1}
    return {"num_cpus": 0}


def described(reserved: dict[str, float]) -> str:
    """The task's resources in words, for the driver's first line."""
    if reserved.get("num_gpus"):
        return "a GPU of its own"
    return "a CPU of its own" if reserved.get("num_cpus") else "the training workers' CPUs, shared"


def validation_config(reserved: dict[str, float]) -> ray.train.ValidationConfig:
    """The TorchTrainer's validation: `validate` in a task of `reserved` resources, not retried
    (a failed validation is said by rank 0; the run goes on)."""
    return ray.train.ValidationConfig(  # RAY
        fn=validate,  # type: ignore[arg-type]  # Ray's protocol takes **kwargs; validate names its one
        task_config=ray.train.ValidationTaskConfig(fn_kwargs={"on_gpu": bool(reserved.get("num_gpus"))}),
        ray_remote_kwargs={**reserved, "max_retries": 0},
    )


def validate(checkpoint: ray.train.Checkpoint, on_gpu: bool = False) -> dict[str, Any]:
    """Ray's validation task: score the checkpoint's model on the run's val split in this process
    (its own loader, no workers: the task holds one CPU at most), then, in the run folder, keep
    best/ where it beats the one there and leave the epoch's validation row for rank 0 to land;
    returns the numbers in-loop validation gives an epoch's row."""
    started = time.perf_counter()
    with checkpoint_folder(checkpoint) as folder:
        assert folder is not None
        trained = load_trained(folder)
        cfg = TrainConfig.from_dict(trained.config)
        scoring = Scoring.of(trained, dataclasses.replace(cfg, loader_workers=0))
        numbers = validation_numbers(evaluate(scoring, World(device="cuda" if on_gpu else "cpu")))
        row = json.loads((Path(folder) / files.CHECKPOINT_ROW).read_text())
        seconds = time.perf_counter() - started
        leave(cfg, {**row, **numbers}, validation_row(row, numbers, seconds), folder)
    return {**numbers, SECONDS: round(seconds, 3)}


def leave(cfg: TrainConfig, merged: dict[str, Any], validated: dict[str, Any], folder: str) -> None:
    """In the run folder (cfg.out: a path, or a bucket's prefix): best/ from the checkpoint in
    `folder` where `merged` (its epoch row with the validation's numbers) beats best/'s top-1, then
    the validation row for rank 0. Ray runs one validation at a time: no other task writes best/
    meanwhile, and the ranks do not validate."""
    run = open_run_dir(cfg)
    if run is None:  # storage raywds cannot write (gs://): Ray's checkpoints alone
        return
    run.start()
    try:
        if run.beats_best(merged):
            run.keep_best(merged, load_checkpoint(folder))
        run.put_text(files.validated(validated["epoch"]), json.dumps(validated) + "\n")
    finally:
        run.close()


POLL_S = 0.5
"""How often rank 0, at the end of its run, asks Ray whether a validation is still running."""


class Landing:
    """Rank 0's side: each epoch's validation row, left in the run folder by its task, landed once
    in `run_dir`'s rows (and through them its tracking runs and TensorBoard). `due`: whether an
    epoch (from 1) is one the run validates (--val-every, the last)."""

    def __init__(self, run_dir: RunDir | None, due: Callable[[int], bool]):
        self.run_dir, self.due = run_dir, due
        self.landed: set[int] = run_dir.validated() if run_dir is not None else set()
        """Epochs whose validation is in the rows (a restarted rank 0 finds the earlier run's)."""
        self.reached = 0
        """The last epoch this rank 0 reported."""

    def land(self, metrics: dict[str, Any] | None = None, *, wait: bool = False) -> None:
        """After a report of `metrics`: land the validations left so far; `wait`: first wait until
        Ray runs none (at the run's end), then say which epochs have none."""
        if metrics is not None and kind(metrics) == "epoch":
            self.reached = max(self.reached, int(metrics["epoch"]))
        if self.run_dir is None:
            return
        if wait:
            while any(
                r.status.value == "PENDING_VALIDATION"
                for r in ray.train.get_all_reported_checkpoints(  # RAY
                    consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED
                )
            ):
                time.sleep(POLL_S)
        for epoch in range(1, self.reached + 1):
            if epoch in self.landed or not self.due(epoch):
                continue
            text = self.run_dir.get_text(files.validated(epoch))
            if text is None:
                if wait:
                    log.warning(
                        f"epoch {epoch}: its validation task left no numbers (it failed or timed out: Ray's logs "
                        "under its session folder, logs/, say why)"
                    )
                continue
            row = json.loads(text)
            self.run_dir.append(row)
            self.landed.add(epoch)
            log.info(
                f"epoch {epoch} validated apart: top-1 {row['val_top1']:.3f}  top-5 {row['val_top5']:.3f}  "
                f"loss {row['val_loss']:.3f}  ({row['validation_s']:.1f} s)"
            )


__all__ = ["Landing", "described", "task_resources", "validate", "validation_config"]
