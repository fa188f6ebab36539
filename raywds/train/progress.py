"""What rank 0 tells as a run goes: a progress bar with ETA on a terminal, a progress line
(and a `"kind": "progress"` row in the run's metrics.jsonl) every `log_every`, the line
after each epoch and the summary line at the end. Lines are logged (INFO); the console
(raywds.console) prints them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time

from tqdm import tqdm

from raywds.runs.folder import Metrics, RunDir
from raywds.runs.rows import ProgressRow, kind
from raywds.train.config import TrainConfig
from raywds.train.doctor import diagnose
from raywds.train.loop import EpochResult
from raywds.train.timing import stage_times
from raywds.world import World

log = logging.getLogger(__name__)


DOCTOR_EVERY_S = 180.0
"""How often rank 0's progress lines carry the doctor's verdict on its own steps so far."""


class ProgressLog:
    """Rank 0's view inside an epoch."""

    def __init__(
        self, cfg: TrainConfig, world: World, epoch: int, num_steps: int, run_dir: RunDir | None, *, first_step: int = 0
    ):
        """`first_step`: the run's steps before this (part of the) epoch, so rows carry the global step."""
        self.cfg, self.world, self.epoch, self.num_steps, self.run_dir = cfg, world, epoch, num_steps, run_dir
        self.first_step = first_step
        self.last = time.monotonic()
        self.last_doctor = -math.inf
        # Only a bar that is drawn is made: even a disabled tqdm starts tqdm's monitor thread, and
        # every thread alive when the DataLoader forks its workers is a lock a worker may inherit held.
        on = world.is_main and sys.stderr.isatty()
        desc = f"epoch {epoch + 1}/{cfg.epochs}"
        self.bar = tqdm(total=num_steps, desc=desc, unit="step", leave=False) if on else None

    def update(self, step: int, so_far: EpochResult, lr: float, data_from: str) -> None:
        """After in-epoch `step`, with the rank's counts `so_far` (rank 0 logs and keeps a row)."""
        if self.bar is not None:
            self.bar.update(1)
        if not self.world.is_main or time.monotonic() - self.last < self.cfg.log_every:
            return
        self.last = time.monotonic()
        seconds, num_samples, loss_sum, data_wait_s = (
            so_far.seconds,
            so_far.num_samples,
            so_far.loss_sum,
            so_far.data_wait_s,
        )
        row = ProgressRow(
            kind="progress",
            time=time.time(),
            epoch=self.epoch + 1,
            step=self.first_step + step,
            step_in_epoch=step,
            steps_in_epoch=self.num_steps,
            loss=loss_sum / max(num_samples, 1),
            lr=lr,
            images_per_s_rank0=num_samples / max(seconds, 1e-9),
            data_wait_rank0=data_wait_s / max(seconds, 1e-9),
            eta_epoch_s=(self.num_steps - step) * seconds / step,
            doctor_rank0=diagnose({"stages": stage_times(self.world, so_far, self.cfg, data_from, alone=True)})[0],
        )
        doctor = ""
        if time.monotonic() - self.last_doctor >= DOCTOR_EVERY_S:  # the first row's, then every few minutes
            self.last_doctor = time.monotonic()
            doctor = f"\n  doctor (rank 0 so far): {row['doctor_rank0']}"
        with tqdm.external_write_mode() if self.bar is not None else contextlib.nullcontext():
            log.info(
                f"epoch {row['epoch']} step {step}/{self.num_steps}  loss {row['loss']:.3f}  lr {lr:.4g}  "
                f"images/s {row['images_per_s_rank0'] * self.world.world_size:.0f} (~{self.world.world_size} ranks)  "
                f"data wait {100 * row['data_wait_rank0']:.0f}%  epoch ends in {row['eta_epoch_s']:.0f} s{doctor}"
            )
        if self.run_dir is not None:
            self.run_dir.append(row)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _skipped(m: Metrics) -> str:
    """What an epoch skipped, when it skipped anything (resample mode)."""
    parts = []
    if m.get("bad_samples"):
        parts.append(f"{m['bad_samples']} bad samples ({m.get('bad_samples_distinct', m['bad_samples'])} distinct)")
    if m.get("bad_shards"):
        parts.append(f"{m['bad_shards']} bad shards")
    retried = f"  {m['read_retries']} shard reads retried" if m.get("read_retries") else ""
    return (f"  skipped {' and '.join(parts)}" if parts else "") + retried


def epoch_line(m: Metrics, epochs: int, *, size: bool = False) -> str:
    """The epoch's line; with `size` (--progressive-resize) the crop side it trained at."""
    val = f"  val top-1 {m['val_top1']:.3f}  top-5 {m['val_top5']:.3f}" if "val_top1" in m else ""
    ema = f"  (EMA {m['val_top1_ema']:.3f})" if "val_top1_ema" in m else ""
    px = f"  at {m['image_size_px']} px" if size and "image_size_px" in m else ""
    return (
        f"epoch {m['epoch']}/{epochs}  loss {m['train_loss']:.3f}{val}{ema}{px}  images/s {m['images_per_s']:.1f}"
        f"  data wait {100 * m['data_wait_max']:.0f}%{_skipped(m)}"
    )


def summary(m: Metrics) -> str:
    """The end of a run: the summary line, then the doctor's verdict on its last epoch."""
    if kind(m) != "epoch" or "stages" not in m:
        return summary_line(m)
    return summary_line(m) + "\n" + "\n".join("doctor: " + line for line in diagnose(m))


def summary_line(m: Metrics) -> str:
    """The one line a script can parse at the end of a run."""
    if kind(m) == "checkpoint":
        return (
            f"stopped at step {m['step']} inside epoch {m['epoch'] + 1}  samples seen {m['samples_seen']}  "
            "(continue with --resume)"
        )
    bad = (
        f"  bad samples skipped {m['bad_samples_total']} "
        f"({m.get('bad_samples_distinct_total', m['bad_samples_total'])} distinct, counted by epoch)"
        if m.get("bad_samples_total")
        else ""
    )
    val = f"  top-1 {m['val_top1']:.3f}  top-5 {m['val_top5']:.3f}" if "val_top1" in m else "  (no val split)"
    return f"epochs {m['epoch']}{val}  samples seen {m['samples_seen']}  images/s {m['images_per_s']:.1f}{bad}"
