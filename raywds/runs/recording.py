"""The run section of a run's config: where a run keeps its record and how often it writes it,
its folder, its trackers, its checkpoints and notices, where a resume starts. The runs part declares
and checks it; the training config (raywds.train.config.TrainConfig) is composed of it.

    recording = Recording(out="runs/first", tracking=["mlflow"], checkpoint_every_steps=500)
    recording.trackers()                 # ['mlflow']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from raywds.fields import MAX_EPOCHS, MAX_SECONDS, MAX_STEPS, PATH, PLACE, check_fields, flag

TrackerName = Literal["mlflow", "wandb", "tensorboard"]
"""The names --tracking takes: raywds.runs.tracking.TRACKERS's."""


@dataclass(frozen=True, kw_only=True)
class Recording:
    """Where a run's record goes and how often: its folder, progress lines, TensorBoard and the
    trackers, validations, checkpoints, notices, a step limit, a resume and the audit trail."""

    out: str = field(default="runs/local", metadata=flag(form=PATH))
    """Where checkpoints and metrics go when not running under Ray (runs/demo for --demo)."""
    log_every: float = field(default=60.0, metadata=flag(minimum=0, maximum=MAX_SECONDS))
    """Rank 0 prints a progress line (loss, lr, images/s, data wait, ETA) this often inside an epoch."""
    tensorboard: bool = False
    """Rank 0 also writes the epoch and progress rows of metrics.jsonl as TensorBoard scalars to
    RUN_DIR/tensorboard/ (needs the tensorboard extra: pip install 'raywds[tensorboard]')."""
    tracking: list[TrackerName] | None = field(default=None, metadata=flag(append=True))
    """Also send the config and each epoch's (and in-epoch checkpoint's) numbers to these (repeatable): mlflow
    (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME), wandb (WANDB_PROJECT, WANDB_MODE), tensorboard (as --tensorboard);
    one tracking run per training run, through resumes and restarts."""
    tracking_checkpoint: bool = False
    """With --tracking mlflow or wandb: send best/checkpoint.pt as an artifact at the run's end."""
    val_every: int = field(default=1, metadata=flag(minimum=1, maximum=MAX_EPOCHS))
    """Validate every this many epochs (and always after the last)."""
    checkpoint_every_steps: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_STEPS))
    """Also checkpoint inside an epoch, every this many steps (at steps every rank reaches)."""
    notice_every: int | None = field(default=10, metadata=flag(minimum=1, maximum=MAX_STEPS))
    """Every this many steps, every rank asks whether a notice came (Ray's preemption notice, or
    SIGTERM to any rank) and checkpoints on one at once (None: never ask)."""
    max_steps: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_STEPS))
    """Stop, with a checkpoint, after this many steps in all; a later run with resume goes on."""
    resume: str | None = field(default=None, metadata=flag(form=PLACE))
    """A checkpoint (file, or Ray checkpoint directory) to continue from: weights, optimizer and data position."""
    audit_dir: str | None = field(default=None, metadata=flag(form=PATH))
    """Write the id of every sample trained on, per epoch, rank and segment, here (`raywds audit` checks them)."""

    def __post_init__(self) -> None:
        check_fields(self, Recording)  # each field's type, choices, range and form, as declared above

    def trackers(self) -> list[str]:
        """What rank 0 sends the rows to: --tracking's, and tensorboard for --tensorboard (the older flag)."""
        return list(dict.fromkeys([*(self.tracking or []), *(["tensorboard"] if self.tensorboard else [])]))


__all__ = ["Recording", "TrackerName"]
