"""The training loop. It never imports ray: Ray (raywds.ray_train) and the local launcher
both call `train(cfg, world, report)`.

    raywds train --data shards/ --model resnet18 --epochs 3          # one process
    torchrun --nproc-per-node 4 -m raywds.train --data shards/         # DDP without Ray (same flags)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from raywds.compute import Compute
from raywds.config import TrainConfig
from raywds.errors import ConfigError, DataError, RaywdsError
from raywds.loader import Batch, check_plan, epoch_plan, train_loader, val_loader
from raywds.plan import EpochPlan
from raywds.position import Ledger, Position, check_same_shards, shard_entries
from raywds.shards import read_manifest
from raywds.world import World

CHECKPOINT_FILE = "checkpoint.pt"

Metrics = dict[str, Any]
# report(metrics, checkpoint): called on every rank after every epoch; checkpoint only on rank 0.
Report = Callable[[Metrics, dict[str, Any] | None], None]


class DemoNet(nn.Module):
    """A small CNN that learns the demo data in a few CPU minutes."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            )

        self.features = nn.Sequential(block(3, width), block(width, 2 * width), block(2 * width, 4 * width))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build_model(name: str, num_classes: int) -> nn.Module:
    """`demo`, or any torchvision classification model name (random init: no downloads)."""
    if name == "demo":
        return DemoNet(num_classes)
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ConfigError(f"unknown model {name!r}; use `demo` or a torchvision model such as resnet50 ({len(available)} known)")
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def make_optimizer(model: nn.Module, cfg: TrainConfig, world: World) -> torch.optim.Optimizer:
    """SGD (nesterov momentum) or AdamW; weight decay only on weights, never on norms and biases."""
    lr = cfg.peak_lr(world.world_size)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)


def lr_at(cfg: TrainConfig, world: World, progress_epochs: float) -> float:
    """Linear warm-up, then cosine decay to zero, as a function of epochs done (fractional).

    A function of progress rather than a stepped scheduler: in split mode ranks take different
    step counts, yet must agree on the rate at every epoch boundary."""
    peak = cfg.peak_lr(world.world_size)
    if progress_epochs < cfg.warmup_epochs:
        return peak * progress_epochs / cfg.warmup_epochs
    span = max(cfg.num_epochs - cfg.warmup_epochs, 1e-9)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress_epochs - cfg.warmup_epochs) / span)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@dataclass
class EpochResult:
    """This rank's counts, updated as the epoch runs (after_step sees them) and returned at its end."""

    num_samples: int = 0
    loss_sum: float = 0.0
    seconds: float = 0.0
    num_steps: int = 0
    stopped: bool = False
    """True when `after_step` asked to stop before the epoch's end."""
    data_wait_s: float = 0.0
    """Time the loop spent waiting for the loader."""
    bad_samples: list[str] = field(default_factory=list)
    """resample mode: why each skipped sample could not be used (the loader workers' words)."""
    num_bad_shards: int = 0
    """resample mode: shards skipped as unreadable."""


class CollectiveError(RaywdsError):
    """A collective failed or timed out: another rank stalled or died."""


def _is_collective_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in ("timed out", "timeout", "gloo", "nccl", "connection closed", "connection reset"))


def train_epoch(
    model: nn.Module,
    batches: Iterable[Batch],
    optimizer: torch.optim.Optimizer,
    lr: Callable[[int], float],
    world: World,
    compute: Compute,
    *,
    uneven: bool,
    label_smoothing: float = 0.0,
    after_step: Callable[[int, Batch, EpochResult], bool] | None = None,
    where: str = "",
    pg_timeout_s: float | None = None,
) -> EpochResult:
    """One pass; `lr(steps done)` sets the rate before each step, and `after_step(steps done,
    batch, counts so far)` runs after it and may stop the epoch by returning True. With `uneven` (split mode)
    Join lets ranks that run out early shadow the collectives of the rest."""
    model.train()
    loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    r = EpochResult()
    start = time.perf_counter()
    joinable = uneven and isinstance(model, DistributedDataParallel)
    try:
        with Join([model]) if joinable else contextlib.nullcontext():  # type: ignore[list-item]
            it = iter(batches)
            while True:
                asked = time.perf_counter()
                batch = next(it, None)
                r.data_wait_s += time.perf_counter() - asked  # time the step waited for the loader
                if batch is None:
                    break
                set_lr(optimizer, lr(r.num_steps))
                images, labels = compute.inputs(batch.images, batch.labels)
                with compute.autocast():
                    loss = loss_fn(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                r.num_steps += 1
                r.num_samples += len(labels)
                r.bad_samples += batch.bad_samples
                r.num_bad_shards += len(batch.bad_shards)
                r.loss_sum += loss.item() * len(labels)
                r.seconds = time.perf_counter() - start
                if after_step is not None and after_step(r.num_steps, batch, r):
                    r.stopped = True
                    break
    except RuntimeError as e:
        if world.distributed and _is_collective_failure(e):
            raise CollectiveError(
                f"rank {world.rank} of {world.world_size}: a collective failed {where} step {r.num_steps + 1} "
                f"after {time.perf_counter() - start:.0f} s (process-group timeout {pg_timeout_s} s): another rank "
                f"stalled or died, see its log. {str(e).splitlines()[0][:300]}"
            ) from e
        raise
    r.seconds = time.perf_counter() - start
    return r


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[Batch], world: World, compute: Compute) -> dict[str, float]:
    """Exact validation: each rank sums its share, then one all_reduce, so uneven ranks never block."""
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    totals = torch.zeros(4, dtype=torch.float64, device=world.device)  # top1, top5, loss, count
    for batch in batches:
        images, labels = compute.inputs(batch.images, batch.labels)
        with compute.autocast():
            logits = model(images).float()
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hits = top.eq(labels[:, None])
        totals += torch.tensor(
            [hits[:, 0].sum().item(), hits.any(dim=1).sum().item(), loss_fn(logits, labels).item(), len(labels)],
            dtype=torch.float64,
            device=world.device,
        )
    if world.distributed:
        dist.all_reduce(totals)
    top1, top5, loss, count = totals.tolist()
    count = max(count, 1.0)
    return {"val_top1": top1 / count, "val_top5": top5 / count, "val_loss": loss / count, "val_samples": int(count)}


def _sum_and_max(world: World, total: list[float], longest: float) -> tuple[list[float], float]:
    if not world.distributed:
        return total, longest
    t = torch.tensor(total + [0.0], dtype=torch.float64, device=world.device)
    m = torch.tensor([longest], dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return t.tolist()[:-1], m.item()


def _per_rank(world: World, values: list[float]) -> list[list[float]]:
    """Each rank's `values`, on every rank (one all_reduce of a ranks x values table)."""
    table = torch.zeros(world.world_size, len(values), dtype=torch.float64, device=world.device)
    table[world.rank] = torch.tensor(values, dtype=torch.float64)
    if world.distributed:
        dist.all_reduce(table)
    return table.tolist()  # type: ignore[no-any-return]


def checkpoint_file(path: str) -> Path:
    """A checkpoint file, or checkpoint.pt in a directory (a run folder or a Ray checkpoint)."""
    where = Path(path)
    if where.is_dir():
        where = where / CHECKPOINT_FILE
    if not where.is_file():
        raise ConfigError(f"no checkpoint at {where}: give a checkpoint.pt or the folder holding it (--resume)")
    return where


def load_checkpoint(path: str) -> dict[str, Any]:
    return torch.load(checkpoint_file(path), map_location="cpu", weights_only=False)


@dataclass
class Progress:
    """Counters that survive a resume."""

    epoch: int = 0
    steps: int = 0
    """Steps so far, counting each finished epoch as its longest rank's batches."""
    samples_seen: int = 0
    position: Position | None = None
    """Inside an unfinished epoch: what it has delivered."""
    bad_samples: int = 0
    """Samples skipped as undecodable in the finished epochs (resample mode)."""


class Audit:
    """With `audit_dir`: one file per (epoch, rank, process) listing each trained sample's key."""

    def __init__(self, audit_dir: str | None, rank: int):
        self.dir = Path(audit_dir) if audit_dir else None
        self.rank = rank
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, epoch: int, keys: list[str]) -> None:
        if self.dir is not None:
            with (self.dir / f"epoch{epoch:04d}-rank{self.rank:05d}-pid{os.getpid()}.keys").open("a") as f:
                f.write("".join(k + "\n" for k in keys))


class ProgressLog:
    """Rank 0's view inside an epoch: a progress bar with ETA on a terminal, and every
    `log_every_s` a line (and, for local runs, a `"kind": "progress"` row in metrics.jsonl)."""

    def __init__(self, cfg: TrainConfig, world: World, epoch: int, num_steps: int, report: Report | None):
        self.cfg, self.world, self.epoch, self.num_steps = cfg, world, epoch, num_steps
        self.file = report.metrics_path if isinstance(report, LocalReport) else None
        self.last = time.monotonic()
        on = world.is_main and sys.stderr.isatty()
        self.bar = tqdm(total=num_steps, desc=f"epoch {epoch + 1}/{cfg.num_epochs}", unit="step", disable=not on, leave=False)

    def update(self, step: int, r: EpochResult, lr: float) -> None:
        self.bar.update(1)
        if not self.world.is_main or time.monotonic() - self.last < self.cfg.log_every_s:
            return
        self.last = time.monotonic()
        row: dict[str, Any] = {
            "kind": "progress", "epoch": self.epoch + 1, "step_in_epoch": step, "steps_in_epoch": self.num_steps,
            "loss": r.loss_sum / max(r.num_samples, 1), "lr": lr,
            "images_per_s_rank0": r.num_samples / max(r.seconds, 1e-9), "data_wait_rank0": r.data_wait_s / max(r.seconds, 1e-9),
            "eta_epoch_s": (self.num_steps - step) * r.seconds / step,
        }  # fmt: skip
        self.bar.write(
            f"epoch {row['epoch']} step {step}/{self.num_steps}  loss {row['loss']:.3f}  lr {lr:.4g}  "
            f"images/s {row['images_per_s_rank0'] * self.world.world_size:.0f} (~{self.world.world_size} ranks)  "
            f"data wait {100 * row['data_wait_rank0']:.0f}%  epoch ends in {row['eta_epoch_s']:.0f} s"
        )
        if self.file is not None:
            with self.file.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.bar.close()


class Trainer:
    """One rank's run: model, optimizer, data and the counters; `fit()` is the epoch loop."""

    def __init__(self, cfg: TrainConfig, world: World, report: Report | None, resume: dict[str, Any] | None):
        torch.manual_seed(cfg.seed)
        self.cfg, self.world, self.report = cfg, world, report
        self.manifest = read_manifest(cfg.data, shards_at=cfg.shards_at)
        self.num_samples = self.manifest.num_samples("train")
        self.compute = Compute.for_run(cfg, world.device)
        self.model = self.compute.model(build_model(cfg.model, len(self.manifest.classes)))
        self.wrapped: nn.Module = self.model
        if world.distributed:
            device_ids = [world.local_rank] if world.device.startswith("cuda") else None
            self.wrapped = DistributedDataParallel(self.model, device_ids=device_ids)
        if cfg.compile:
            self.wrapped = torch.compile(self.wrapped)  # type: ignore[assignment]
        self.optimizer = make_optimizer(self.model, cfg, world)
        self.progress = Progress()
        if resume is not None:
            self.restore(resume)
        self.audit = Audit(cfg.audit_dir, world.rank)
        self.metrics: Metrics = {}

    def restore(self, state: dict[str, Any]) -> None:
        if state["classes"] != self.manifest.classes:
            raise ConfigError(f"the checkpoint's {len(state['classes'])} classes differ from the data's {len(self.manifest.classes)}; resume with the same --data")
        if "shards" in state:
            check_same_shards(state["shards"], self.manifest)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        position = Position.from_state(state["position"]) if state.get("position") else None
        if position is not None:
            position.check_compatible(self.manifest, self.cfg.mode)
            if position.samples_done == 0:
                position = None
        self.progress = Progress(
            epoch=state["epoch"], steps=state["steps"], samples_seen=state["samples_seen"], position=position, bad_samples=state.get("bad_samples", 0)
        )  # fmt: skip

    def fit(self) -> Metrics:
        """Train until cfg.num_epochs or cfg.max_steps; returns the last metrics (the same on every rank)."""
        while self.progress.epoch < self.cfg.num_epochs:
            if self.run_epoch(self.progress.epoch):
                break
        return self.metrics

    def run_epoch(self, epoch: int) -> bool:
        """Train `epoch` (or what is left of it), evaluate, report; True when max_steps stopped it."""
        cfg, world, manifest = self.cfg, self.world, self.manifest
        position = self.progress.position if self.progress.position and self.progress.position.epoch == epoch else None
        plan = epoch_plan(manifest, cfg, world.world_size, epoch=epoch, position=position)
        check_plan(plan, manifest)
        batches = train_loader(manifest, cfg, world, plan, epoch=epoch, position=position)
        ledger = Ledger(self.num_samples)
        start = self.progress  # where this run's part of the epoch begins
        done_before = position.samples_done if position else 0
        step_before = position.step if position else 0

        global_batch = world.world_size * cfg.batch_size_per_rank
        epoch_size = cfg.batches_per_epoch * global_batch if cfg.batches_per_epoch else self.num_samples

        def lr(step: int) -> float:
            """The rate for step `step` (0-based) of this run's part of the epoch: the schedule's
            value where the step ends, so the first step of a warm-up already learns."""
            return lr_at(cfg, world, epoch + min((done_before + (step + 1) * global_batch) / epoch_size, 1.0))

        progress = ProgressLog(cfg, world, epoch, len(batches), report=self.report)
        bad_allowed = cfg.bad_samples_allowed(sum(plan.samples_per_rank))  # split mode never skips, so only resample's counts

        def after_step(step: int, batch: Batch, so_far: EpochResult) -> bool:
            ledger.mark(batch.ids)
            self.audit.write(epoch, batch.keys)
            progress.update(step, so_far, lr(step - 1))
            if len(so_far.bad_samples) > bad_allowed:  # this rank alone is past the job's bound
                raise too_many_bad(so_far.bad_samples, bad_allowed, cfg)
            # Only where every rank is still in the loop: collectives here cannot meet a joined rank.
            if step > plan.min_batches:
                return False
            at_stop = cfg.max_steps is not None and start.steps + step >= cfg.max_steps
            at_checkpoint = (  # not at the epoch's last step: the epoch's own checkpoint follows
                cfg.checkpoint_every_steps is not None and (step_before + step) % cfg.checkpoint_every_steps == 0 and step < plan.max_batches
            )
            if at_stop or at_checkpoint:
                done = done_before + step * global_batch  # resample: every batch is full
                self.checkpoint_inside(epoch, step_before + step, start.steps + step, done, ledger, position, plan, start)
            return at_stop

        try:
            result = train_epoch(
                self.wrapped, batches, self.optimizer, lr, world, self.compute, uneven=plan.mode == "split",
                label_smoothing=cfg.label_smoothing, after_step=after_step, where=f"in epoch {epoch + 1}", pg_timeout_s=cfg.pg_timeout_s,
            )  # fmt: skip
        finally:
            progress.close()
        if result.stopped:
            return True
        self.finish_epoch(epoch, result, ledger, position, plan, start, bad_allowed)
        return cfg.max_steps is not None and self.progress.steps >= cfg.max_steps

    def consumed(self, ledger: Ledger, position: Position | None) -> np.ndarray:
        """Times each sample was trained on this epoch, over all ranks and earlier runs."""
        counts = ledger.total(self.world)
        if position is not None and position.consumed is not None:
            counts = counts + position.consumed
        return counts

    def checkpoint_inside(self, epoch: int, step: int, steps: int, done: int, ledger: Ledger, position: Position | None, plan: EpochPlan, start: Progress) -> None:
        """Save the data position at in-epoch `step` (`steps` in all, `done` samples of the
        epoch); `start` is the progress this run's part of the epoch began from."""
        consumed = None
        if plan.mode == "split":  # resample mode resumes from the counts alone: no gather needed
            consumed = self.consumed(ledger, position) > 0
            done = int(consumed.sum())
        here = Position(
            mode=plan.mode, epoch=epoch, step=step, samples_done=done, consumed=consumed, dataset=self.manifest.fingerprint("train"),
        )  # fmt: skip
        samples_seen = start.samples_seen + done - (position.samples_done if position else 0)
        self.progress = Progress(epoch=epoch, steps=steps, samples_seen=samples_seen, position=here, bad_samples=start.bad_samples)
        metrics = {"epoch": epoch, "step": steps, "samples_seen": samples_seen, "epoch_samples_done": done, "inside_epoch": True}
        if self.world.is_main:
            print(f"step {steps}: checkpoint inside epoch {epoch + 1} ({done}/{self.num_samples} samples done)", flush=True)
        self.emit(metrics)

    def finish_epoch(self, epoch: int, result: EpochResult, ledger: Ledger, position: Position | None, plan: EpochPlan, start: Progress, bad_allowed: int) -> None:
        cfg, world = self.cfg, self.world
        (num_samples, loss_sum, num_bad, bad_shards), seconds = _sum_and_max(
            world, [result.num_samples, result.loss_sum, len(result.bad_samples), result.num_bad_shards], result.seconds
        )  # fmt: skip
        if num_bad > bad_allowed:
            raise too_many_bad(result.bad_samples, bad_allowed, cfg, job_total=int(num_bad))
        ranks = _per_rank(world, [result.num_samples / max(result.seconds, 1e-9), result.data_wait_s / max(result.seconds, 1e-9)])
        counts = self.consumed(ledger, position)
        metrics: Metrics = {
            "epoch": epoch + 1,
            "step": start.steps + plan.max_batches,
            "train_loss": loss_sum / max(num_samples, 1),
            "train_samples": int(num_samples),
            "samples_seen": start.samples_seen + int(num_samples),
            "bad_samples": int(num_bad),
            "bad_samples_total": start.bad_samples + int(num_bad),
            "bad_shards": int(bad_shards),
            "epoch_samples": int(counts.sum()),
            "epoch_distinct": int((counts > 0).sum()),
            "epoch_duplicates": int(np.maximum(counts - 1, 0).sum()),
            "epoch_missing": int((counts == 0).sum()),
            "images_per_s": num_samples / max(seconds, 1e-9),
            "images_per_s_per_rank": [round(r[0], 2) for r in ranks],
            "data_wait_per_rank": [round(r[1], 4) for r in ranks],
            "data_wait_max": max(r[1] for r in ranks),
            "lr": lr_at(cfg, world, epoch + 1),
        }
        if plan.mode == "split" and (metrics["epoch_duplicates"] or metrics["epoch_missing"] or metrics["epoch_samples"] != self.num_samples):
            raise DataError(
                f"split epoch {epoch + 1} was not exact: {metrics['epoch_samples']} samples trained, the manifest has "
                f"{self.num_samples}; {metrics['epoch_duplicates']} repeated, {metrics['epoch_missing']} missing"
            )
        if (epoch + 1) % cfg.val_every_epochs == 0 or epoch + 1 == cfg.num_epochs:
            metrics.update(evaluate(self.model, val_loader(self.manifest, cfg, world), world, self.compute))
        self.progress = Progress(epoch=epoch + 1, steps=metrics["step"], samples_seen=metrics["samples_seen"], bad_samples=metrics["bad_samples_total"])
        if world.is_main:
            print(epoch_line(metrics, cfg.num_epochs), flush=True)
        self.emit(metrics)

    def emit(self, metrics: Metrics) -> None:
        self.metrics = metrics
        if self.report is not None:
            self.report(metrics, self.state() if self.world.is_main else None)

    def state(self) -> dict[str, Any]:
        """Model, optimizer and position; the learning rate is a function of progress, so it needs no state."""
        position = self.progress.position
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "epoch": self.progress.epoch,
            "steps": self.progress.steps,
            "samples_seen": self.progress.samples_seen,
            "bad_samples": self.progress.bad_samples,
            "position": position.to_state() if position else None,
            "shards": shard_entries(self.manifest),
            "config": self.cfg.to_dict(),
            "classes": self.manifest.classes,
        }


def train(cfg: TrainConfig, world: World, report: Report | None = None, resume: dict[str, Any] | None = None) -> Metrics:
    """Train for cfg.num_epochs (or cfg.max_steps), from `resume` (a checkpoint's state) or
    cfg.resume_from when given; returns the last metrics, the same on every rank."""
    if resume is None and cfg.resume_from:
        resume = load_checkpoint(cfg.resume_from)
    return Trainer(cfg, world, report, resume).fit()


def too_many_bad(reasons: list[str], allowed: int, cfg: TrainConfig, *, job_total: int | None = None) -> DataError:
    """The error past --max-bad-samples: the last bad sample's own line, then the count."""
    count = f"{job_total} bad samples this epoch across ranks" if job_total is not None else f"{len(reasons)} bad samples this epoch on this rank"
    last = f"{reasons[-1]} " if reasons else ""
    return DataError(f"{last}({count}, more than the {allowed} that --max-bad-samples {cfg.max_bad_samples:g} allows); run `raywds verify` on the shards")


def _skipped(m: Metrics) -> str:
    """What an epoch skipped, when it skipped anything (resample mode)."""
    parts = [f"{m[k]} bad {what}" for k, what in (("bad_samples", "samples"), ("bad_shards", "shards")) if m.get(k)]
    return f"  skipped {' and '.join(parts)}" if parts else ""


def epoch_line(m: Metrics, num_epochs: int) -> str:
    val = f"  val top-1 {m['val_top1']:.3f}  top-5 {m['val_top5']:.3f}" if "val_top1" in m else ""
    return (
        f"epoch {m['epoch']}/{num_epochs}  loss {m['train_loss']:.3f}{val}  images/s {m['images_per_s']:.1f}"
        f"  data wait {100 * m['data_wait_max']:.0f}%{_skipped(m)}"
    )


def summary_line(m: Metrics) -> str:
    """The one line a script can parse at the end of a run."""
    if m.get("inside_epoch"):
        return f"stopped at step {m['step']} inside epoch {m['epoch'] + 1}  samples seen {m['samples_seen']}  (continue with --resume)"
    bad = f"  bad samples skipped {m['bad_samples_total']}" if m.get("bad_samples_total") else ""
    return (
        f"epochs {m['epoch']}  top-1 {m['val_top1']:.3f}  top-5 {m['val_top5']:.3f}"
        f"  samples seen {m['samples_seen']}  images/s {m['images_per_s']:.1f}{bad}"
    )


def keep_best(run_dir: Path, metrics: Metrics, state: dict[str, Any]) -> bool:
    """Copy the checkpoint to RUN_DIR/best/ when its validation top-1 beats the one there
    (read from best/metrics.json, so it holds across restarts); True when it did."""
    if "val_top1" not in metrics or not run_dir.is_dir():
        return False
    best = run_dir / "best"
    record = best / "metrics.json"
    if record.is_file() and json.loads(record.read_text()).get("val_top1", -1.0) >= metrics["val_top1"]:
        return False
    best.mkdir(exist_ok=True)
    tmp = best / (CHECKPOINT_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(best / CHECKPOINT_FILE)
    record.write_text(json.dumps(metrics) + "\n")
    return True


class LocalReport:
    """Writes metrics.jsonl, checkpoint.pt (the latest) and best/ (the best validation top-1)
    under `out_dir`; `append` keeps the metrics of the run being resumed."""

    def __init__(self, out_dir: Path, *, append: bool = False):
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = out_dir / "metrics.jsonl"
        self.checkpoint_path = out_dir / CHECKPOINT_FILE
        if not append:
            self.metrics_path.write_text("")

    def __call__(self, metrics: Metrics, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.checkpoint_path)
        keep_best(self.out_dir, metrics, state)


def run_local(cfg: TrainConfig) -> tuple[Metrics, LocalReport | None]:
    """Train in this process, or as one rank of a torchrun job."""
    world = World.from_env()
    if world.distributed:
        backend = "nccl" if world.device.startswith("cuda") else "gloo"
        if world.device.startswith("cuda"):
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.pg_timeout_s))
    resuming_here = cfg.resume_from is not None and Path(cfg.resume_from).resolve() in (Path(cfg.out_dir).resolve(), (Path(cfg.out_dir) / CHECKPOINT_FILE).resolve())
    report = LocalReport(Path(cfg.out_dir), append=resuming_here) if world.is_main else None
    if report is not None:
        (report.out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")  # the resolved config
    try:
        return train(cfg, world, report), report
    finally:
        if world.distributed:
            dist.destroy_process_group()


if __name__ == "__main__":  # torchrun --nproc-per-node N -m raywds.train --data ... (the `raywds train` flags)
    import sys

    from raywds.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
