"""One rank's run: the epoch loop around `train_epoch`, in-epoch checkpoints, exact-epoch
checks, validation and reports. It never imports ray: the launchers (raywds.launch) build
the world and call `train(cfg, world, ...)`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raywds.config import TrainConfig
from raywds.data.columns import sample_counts
from raywds.data.dataset import Manifest, manifest_of
from raywds.errors import DataError
from raywds.loader.loader import Loaders, PerRank
from raywds.loader.settings import LoaderConfig
from raywds.loader.stages import Batch
from raywds.plan.checks import check_plan
from raywds.plan.modes import epoch_plan, parse
from raywds.plan.position import Position, done_in
from raywds.runs.checkpoint import load_checkpoint
from raywds.runs.folder import Metrics, RunDir
from raywds.runs.rows import EpochRow, checkpoint_row
from raywds.train.audit import Audit
from raywds.train.autoworkers import Workers
from raywds.train.compute import Compute
from raywds.train.doctor import diagnose
from raywds.train.ledger import Ledger, gathered, per_rank, sum_and_max, tally
from raywds.train.loop import EpochResult, evaluate, train_epoch
from raywds.train.model import build_model
from raywds.train.optim import lr_at, make_optimizer
from raywds.train.progress import ProgressLog, epoch_line, too_many_bad
from raywds.train.state import Epoch, Progress, check_unfinished, checkpoint_state, restore
from raywds.train.timing import stage_times
from raywds.world import World

log = logging.getLogger(__name__)

# report(metrics, checkpoint): called on every rank after every epoch; checkpoint only on rank 0.
Report = Callable[[Metrics, dict[str, Any] | None], None]


class Trainer:
    """One rank's run: model, optimizer, data and the counters; `fit()` is the epoch loop."""

    def __init__(
        self,
        cfg: TrainConfig,
        world: World,
        report: Report | None,
        resume: dict[str, Any] | None,
        run_dir: RunDir | None = None,
        loaders: Loaders | None = None,
        manifest: Manifest | None = None,
    ):
        torch.manual_seed(cfg.seed)
        self.cfg, self.world, self.run_dir, self.workers = cfg, world, run_dir, Workers(cfg, world)
        if run_dir is not None and cfg.tensorboard:  # first: a missing tensorboard stops the run before any work
            run_dir.open_tensorboard()
        self.loaders: Loaders = loaders if loaders is not None else PerRank()
        self.report = report if report is not None else (run_dir.save if run_dir is not None else None)
        self.manifest = manifest if manifest is not None else manifest_of(cfg)
        self.num_samples = self.manifest.num_samples("train")
        self.shard_sizes = sample_counts(self.manifest.shards("train"))
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
        self.audit = Audit(cfg.audit_dir, world, self.progress.steps)
        self.metrics: Metrics = {}

    def restore(self, state: dict[str, Any]) -> None:
        self.progress = restore(state, self.model, self.optimizer, self.manifest, parse(self.cfg.mode))

    def fit(self) -> Metrics:
        """Train until cfg.epochs or cfg.max_steps; returns the last metrics (the same on every rank)."""
        while self.progress.epoch < self.cfg.epochs:
            if self.run_epoch(self.progress.epoch):
                break
        return self.metrics

    def begin(self, index: int) -> Epoch:
        """Plan `index` (or what is left of it) and refuse a plan that would hang."""
        cfg, world = self.cfg, self.world
        position = self.progress.position if self.progress.position and self.progress.position.epoch == index else None
        done = done_in(position, index)
        plan = epoch_plan(
            self.manifest, cfg, world.world_size, epoch=index, done=done, ranks_per_node=world.ranks_per_node
        )
        check_plan(plan, self.manifest)
        global_batch = world.world_size * cfg.batch_size
        size = cfg.batches_per_epoch * global_batch if cfg.batches_per_epoch else self.num_samples
        bad_allowed = cfg.bad_samples_allowed(sum(plan.samples_per_rank))  # an exact epoch never skips
        return Epoch(index, plan, position, self.progress, Ledger(self.shard_sizes), global_batch, size, bad_allowed)

    def run_epoch(self, index: int) -> bool:
        """Train epoch `index` (or what is left of it), evaluate, report; True when max_steps stopped it."""
        self.cfg = cfg = self.workers.config(index)  # --loader-workers auto: the epoch's count, chosen now
        self.loader_cfg, world = LoaderConfig.of(cfg), self.world
        epoch = self.begin(index)
        batches = self.loaders.train(
            self.manifest, self.loader_cfg, world, epoch.plan, epoch=index, position=epoch.position
        )

        def lr(step: int) -> float:
            """Step `step`'s rate (0-based, this run's part of the epoch) where it ends: warm-up's first step learns."""
            return lr_at(
                cfg, world, index + min((epoch.done_before + (step + 1) * epoch.global_batch) / epoch.size, 1.0)
            )

        progress = ProgressLog(cfg, world, index, len(batches), run_dir=self.run_dir, first_step=epoch.start.steps)

        def after_step(step: int, batch: Batch, so_far: EpochResult) -> bool:
            epoch.ledger.mark(batch.ids)
            self.audit.write(index, batch.ids)
            progress.update(step, so_far, lr(step - 1), self.manifest.base)
            if len(so_far.distinct_bad) > epoch.bad_allowed:  # this rank alone is past the job's bound
                raise too_many_bad(so_far.distinct_bad, len(so_far.bad_samples), epoch.bad_allowed, cfg, "on this rank")
            return self.maybe_checkpoint(epoch, step)

        try:
            result = train_epoch(
                self.wrapped,
                batches,
                self.optimizer,
                lr,
                world,
                self.compute,
                uneven=epoch.plan.mode.exact,
                label_smoothing=cfg.label_smoothing,
                after_step=after_step,
                where=f"in epoch {index + 1}",
                pg_timeout=cfg.pg_timeout,
            )
        finally:
            progress.close()
        if result.stopped:
            return True
        self.finish_epoch(epoch, result)
        return cfg.max_steps is not None and self.progress.steps >= cfg.max_steps

    def maybe_checkpoint(self, epoch: Epoch, step: int) -> bool:
        """After in-epoch `step`: checkpoint when max_steps or checkpoint_every_steps says so, only
        where every rank is still in the loop (collectives cannot meet a joined rank); True: stop."""
        cfg = self.cfg
        if step > epoch.plan.min_batches:
            return False
        at_stop = cfg.max_steps is not None and epoch.start.steps + step >= cfg.max_steps
        at_checkpoint = (  # not at the epoch's last step: the epoch's own checkpoint follows
            cfg.checkpoint_every_steps is not None
            and (epoch.step_before + step) % cfg.checkpoint_every_steps == 0
            and step < epoch.plan.max_batches
        )
        if at_stop or at_checkpoint:
            self.checkpoint_inside(epoch, step)
        return at_stop

    def checkpoint_inside(self, epoch: Epoch, step: int) -> None:
        """Save the data position after in-epoch `step` of this run's part of the epoch."""
        done = epoch.done_before + step * epoch.global_batch  # resample: every batch is full
        shards_done, partial = None, {}
        if epoch.plan.mode.exact:  # resample mode resumes from the counts alone: no gather needed
            counted = tally(epoch.ledger, self.world, epoch.position, flags=True)
            shards_done, partial, done = counted.shards_done, counted.partial, counted.distinct
        here = Position(
            mode=epoch.plan.mode,
            epoch=epoch.index,
            step=epoch.step_before + step,
            samples_done=done,
            shards_done=shards_done,
            partial=partial,
            dataset=self.manifest.fingerprint("train"),
        )
        steps = epoch.start.steps + step
        samples_seen = epoch.start.samples_seen + done - epoch.done_before
        self.progress = Progress(
            epoch=epoch.index,
            steps=steps,
            samples_seen=samples_seen,
            position=here,
            bad_samples=epoch.start.bad_samples,
            bad_samples_distinct=epoch.start.bad_samples_distinct,
        )
        self.audit.segment(steps)
        if self.world.is_main:
            log.info(
                f"step {steps}: checkpoint inside epoch {epoch.index + 1} ({done}/{self.num_samples} samples done)"
            )
        self.emit(checkpoint_row(epoch.index, steps, samples_seen, done))

    def finish_epoch(self, epoch: Epoch, result: EpochResult) -> None:
        cfg, world = self.cfg, self.world
        metrics = self.epoch_metrics(epoch, result)
        self.workers.measured(metrics)
        if epoch.plan.mode.exact and (
            metrics["epoch_duplicates"] or metrics["epoch_missing"] or metrics["epoch_samples"] != self.num_samples
        ):
            raise DataError(
                f"split epoch {epoch.index + 1} was not exact: {metrics['epoch_samples']} samples trained, "
                f"the manifest has {self.num_samples}; "
                f"{metrics['epoch_duplicates']} repeated, {metrics['epoch_missing']} missing"
            )
        validate = (epoch.index + 1) % cfg.val_every == 0 or epoch.index + 1 == cfg.epochs
        if validate and "val" in self.manifest.splits:  # a train-only manifest trains without validation
            batches = self.loaders.val(self.manifest, self.loader_cfg, world)
            metrics.update(evaluate(self.model, batches, world, self.compute))
        self.progress = Progress(
            epoch=epoch.index + 1,
            steps=metrics["step"],
            samples_seen=metrics["samples_seen"],
            bad_samples=metrics["bad_samples_total"],
            bad_samples_distinct=metrics["bad_samples_distinct_total"],
        )
        self.audit.segment(self.progress.steps)
        if world.is_main:
            log.info(epoch_line(metrics, cfg.epochs) + "\n  doctor: " + diagnose(metrics)[0])
        self.emit(metrics)

    def epoch_metrics(self, epoch: Epoch, result: EpochResult) -> Metrics:
        """The job's numbers for the epoch (collectives: every rank calls this at its end)."""
        world, start = self.world, epoch.start
        sums = [result.num_samples, result.loss_sum, len(result.bad_samples), result.num_bad_shards]
        (num_samples, loss_sum, num_bad, bad_shards, retries), seconds = sum_and_max(
            world, [*sums, result.num_read_retries], result.seconds
        )
        # Shards repeat within a resample epoch, and a bad sample with them: the bound is on the
        # distinct ones, job-wide. Every rank sees the same sum, so all gather or none does.
        distinct = dict(gathered(world, [[k, v] for k, v in result.distinct_bad.items()])) if num_bad else {}
        if len(distinct) > epoch.bad_allowed:
            named = result.distinct_bad or distinct  # a rank names its own latest bad sample where it has one
            raise too_many_bad(named, int(num_bad), epoch.bad_allowed, self.cfg, "across ranks", len(distinct))
        ranks = per_rank(
            world, [result.num_samples / max(result.seconds, 1e-9), result.data_wait_s / max(result.seconds, 1e-9)]
        )
        counted = tally(epoch.ledger, world, epoch.position)
        row = EpochRow(
            kind="epoch",
            epoch=epoch.index + 1,
            step=start.steps + epoch.plan.max_batches,
            train_loss=loss_sum / max(num_samples, 1),
            train_samples=int(num_samples),
            samples_seen=start.samples_seen + int(num_samples),
            bad_samples=int(num_bad),
            bad_samples_total=start.bad_samples + int(num_bad),
            bad_samples_distinct=len(distinct),
            bad_samples_distinct_total=start.bad_samples_distinct + len(distinct),
            bad_shards=int(bad_shards),
            read_retries=int(retries),
            epoch_samples=counted.samples,
            epoch_distinct=counted.distinct,
            epoch_duplicates=counted.duplicates,
            epoch_missing=counted.missing,
            images_per_s=num_samples / max(seconds, 1e-9),
            images_per_s_per_rank=[round(r[0], 2) for r in ranks],
            data_wait_per_rank=[round(r[1], 4) for r in ranks],
            data_wait_max=max(r[1] for r in ranks),
            lr=lr_at(self.cfg, world, epoch.index + 1),
            stages=stage_times(world, result, self.cfg, self.manifest.base),
        )
        return {**row}

    def emit(self, metrics: Metrics) -> None:
        self.metrics = metrics
        if self.report is not None:
            self.report(metrics, self.state() if self.world.is_main else None)

    def state(self) -> dict[str, Any]:
        return checkpoint_state(self.model, self.optimizer, self.progress, self.manifest, self.workers.asked)


def train(
    cfg: TrainConfig,
    world: World,
    report: Report | None = None,
    resume: dict[str, Any] | None = None,
    *,
    run_dir: RunDir | None = None,
    loaders: Loaders | None = None,
    manifest: Manifest | None = None,
) -> Metrics:
    """Train for cfg.epochs (or cfg.max_steps), from `resume` (a checkpoint's state) or cfg.resume;
    returns the last metrics, the same on every rank. Rank 0's `run_dir` gets progress rows and is the report
    unless `report` is given; `loaders`: where batches come from; `manifest`: cfg.data's, where known."""
    if resume is None and cfg.resume:
        resume = load_checkpoint(cfg.resume)
        check_unfinished(resume, cfg)
    return Trainer(cfg, world, report, resume, run_dir, loaders, manifest).fit()
