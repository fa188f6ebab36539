"""`--tracking` for a Lightning fit: Lightning's own loggers for the tools the config names, one
tracking run per training run, its id kept in RUN_DIR/tracking.json as `raywds train` keeps it.

    trainer = L.Trainer(logger=loggers(cfg), callbacks=[KeepTrackingIds()], ...)

MLflow (`MLFlowLogger`: MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, default `raywds`), W&B
(`WandbLogger`: WANDB_PROJECT, default `raywds`, WANDB_MODE, files in RUN_DIR/wandb/) and
TensorBoard (`TensorBoardLogger` in RUN_DIR/tensorboard/, also for `--tensorboard`). A fit resumed
from a checkpoint into the same --out continues the same tracking runs; Lightning logs at its
global step, which a resume continues. Lightning's loggers call their servers on the training
thread: a tracking server that is down fails or slows the fit as Lightning does, unlike `raywds
train`'s own tracking (raywds.runs.tracking).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from raywds.runs import files
from raywds.runs.tensorboard import TensorBoard
from raywds.runs.tracker import missing
from raywds.runs.tracking import TRACKERS, Mlflow, Wandb
from raywds.train.config import TrainConfig


def _saved(cfg: TrainConfig) -> dict[str, str]:
    path = Path(cfg.out) / files.TRACKING
    return json.loads(path.read_text()) if path.is_file() else {}


def _mlflow(cfg: TrainConfig, saved: dict[str, str]) -> Any:
    from lightning.pytorch.loggers import MLFlowLogger

    return MLFlowLogger(
        experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME") or "raywds",
        tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"),
        run_name=Path(cfg.out).name,
        run_id=saved.get(Mlflow.name),
    )


def _wandb(cfg: TrainConfig, saved: dict[str, str]) -> Any:
    from lightning.pytorch.loggers import WandbLogger

    project = os.environ.get("WANDB_PROJECT") or "raywds"
    return WandbLogger(project=project, id=saved.get(Wandb.name), resume="allow", save_dir=cfg.out)


def _tensorboard(cfg: TrainConfig, saved: dict[str, str]) -> Any:
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(cfg.out, name=files.TENSORBOARD)


LOGGERS: dict[str, Callable[[TrainConfig, dict[str, str]], Any]] = {
    Mlflow.name: _mlflow,
    Wandb.name: _wandb,
    TensorBoard.name: _tensorboard,
}
"""Lightning's logger for each tracker of raywds.runs.tracking.TRACKERS (the same names)."""


def loggers(cfg: TrainConfig) -> list[Any] | bool:
    """Lightning loggers for `cfg.trackers()` (False, Lightning's "none", when there are none)."""
    saved, made = _saved(cfg), list[Any]()
    for tool in cfg.trackers():
        try:
            made.append(LOGGERS[tool](cfg, saved))
        except ModuleNotFoundError as e:
            raise missing(tool, TRACKERS[tool].extra, e) from None
    return made or False


class KeepTrackingIds(pl.Callback):
    """Rank 0 writes its loggers' tracking run ids to RUN_DIR/tracking.json once the fit starts
    (MLflow's run exists by then), for the next fit into the same folder to continue."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        ids = {}
        for logger in trainer.loggers:
            name = type(logger).__name__
            if name == "MLFlowLogger":
                ids[Mlflow.name] = getattr(logger, "run_id")  # noqa: B009 - MLFlowLogger's, not Logger's
            elif name == "WandbLogger":
                ids[Wandb.name] = logger.version
        if ids:
            root = Path(trainer.default_root_dir)
            root.mkdir(parents=True, exist_ok=True)
            (root / files.TRACKING).write_text(json.dumps(ids) + "\n")
