"""A training loop of your own (a Lightning Trainer's fit, say) in Ray Train workers, as
`raywds ray` runs its own: the cluster joined, Ray Train's resources asked for, each worker
handed the config and the folder of the checkpoint Ray restored.

    def fit(cfg: raywds.TrainConfig, restored: str | None) -> None:   # in every worker
        ...
    raywds.run_on_ray(fit, cfg, workers=(2, 4))                         # MIN..MAX: elastic

A restarted or resized worker group calls `fit` again, with the newest checkpoint Ray kept.
Every Ray touchpoint is marked `# RAY`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray.train  # RAY
import torch
from ray.train.torch import TorchTrainer  # RAY

from raywds.launch.cluster import connect, start_autoscaling_coordinator, wait_for_coordinator
from raywds.launch.runstore import checkpoint_folder
from raywds.train.config import TrainConfig

Fit = Callable[[TrainConfig, "str | None"], None]
"""A worker's training: the run's config, and the folder of the checkpoint Ray restored (None at first)."""


def run_on_ray(
    fit: Fit,
    cfg: TrainConfig,
    workers: int | tuple[int, int],
    *,
    storage: str | None = None,
    address: str | None = None,
) -> Any:
    """`fit` in `workers` Ray Train workers (MIN..MAX: elastic) on the cluster at `address` (or
    RAY_ADDRESS, or a new local one); Ray's Result. The run is named for `cfg.out`, its Ray
    checkpoints kept under `storage` (default: `ray/` beside `cfg.out`), restarted up to 3 times."""

    def per_worker(config: dict[str, Any]) -> None:
        with checkpoint_folder(ray.train.get_checkpoint()) as restored:  # RAY: a folder of this rank's own
            fit(TrainConfig.from_dict(config), restored)

    connect(address)
    coordinator = start_autoscaling_coordinator()  # Ray Train asks it for resources as it starts
    out = Path(cfg.out).resolve()
    trainer = TorchTrainer(  # RAY
        per_worker,
        train_loop_config=dataclasses.replace(cfg, out=str(out)).to_dict(),
        scaling_config=ray.train.ScalingConfig(
            num_workers=workers, use_gpu=torch.cuda.is_available()  # type: ignore[arg-type]  # MIN..MAX: elastic
        ),
        run_config=ray.train.RunConfig(
            name=out.name, storage_path=storage or str(out.parent / "ray"),
            failure_config=ray.train.FailureConfig(max_failures=3),
        ),
    )  # fmt: skip
    wait_for_coordinator(coordinator)
    return trainer.fit()  # RAY
