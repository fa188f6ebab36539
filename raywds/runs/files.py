"""The files of a run folder, each name spelled here once (local and bucket runs alike):

RUN_DIR/metrics.jsonl          one row per epoch, checkpoint and progress line (raywds.runs.rows)
RUN_DIR/config.json            the resolved config (RAY_CONFIG beside a Ray run's own files)
RUN_DIR/checkpoint.pt          the latest checkpoint (a Ray run: in each checkpoint_* folder, with
                               metrics.json, the row it was reported with)
RUN_DIR/best/checkpoint.pt     the best epoch's, with best/metrics.json, its row, written last
RUN_DIR/tensorboard/           --tensorboard's event files
RUN_DIR/validated/epoch-N.json `raywds ray --async-validation`: epoch N's validation row, from its task
RUN_DIR/tracking.json          --tracking mlflow/wandb: the tracking runs' ids (raywds.runs.tracking)
RUN_DIR/wandb/                 --tracking wandb: W&B's own files
RUN_DIR/.raywds-lock           held while a run trains into the folder (raywds.runs.lock)
RUN_DIR/last.ckpt              the Lightning DataModule's checkpoints inside an epoch
RUN_DIR/last-step              the step rank 0 trained last (after a restart: the steps trained again)
"""

from __future__ import annotations

METRICS = "metrics.jsonl"
CONFIG = "config.json"
RAY_CONFIG = "raywds-config.json"
"""The config in a Ray run's folder, beside the files Ray Train writes there."""
CHECKPOINT = "checkpoint.pt"
CHECKPOINT_ROW = "metrics.json"
"""Beside a Ray run's checkpoint.pt: the row rank 0 reported it with (what its validation apart adds to)."""
BEST = "best"
BEST_ROW = f"{BEST}/metrics.json"
TENSORBOARD = "tensorboard"


def validated(epoch: int) -> str:
    """Where the task that validated epoch `epoch` (from 1) apart from training leaves its row."""
    return f"validated/epoch-{epoch:04d}.json"


LOCK = ".raywds-lock"
LIGHTNING_CHECKPOINT = "last.ckpt"
LAST_STEP = "last-step"
TRACKING = "tracking.json"
