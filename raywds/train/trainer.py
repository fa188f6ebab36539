"""One rank's run: the epoch loop around `train_epoch`, in-epoch checkpoints, exact-epoch
checks, validation and reports. It never imports ray: the launchers (raywds.launch) build
the world and call `train(cfg, world, ...)`.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raywds.data.dataset import Manifest, manifest_of
from raywds.errors import RaywdsError
from raywds.loader.loader import EpochLoader, Loaders, PerRank
from raywds.loader.stages import BadSample, Batch
from raywds.models.start import Start, start_model, with_preprocessing
from raywds.runs.checkpoint import load_checkpoint
from raywds.runs.folder import Metrics, RunDir, check_trackers
from raywds.runs.rows import EpochRow, checkpoint_row
from raywds.train.autoworkers import Workers
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig
from raywds.train.doctor import diagnose
from raywds.train.ema import ModelEma
from raywds.train.epoch import Epoch, EpochKeeper
from raywds.train.ledger import gathered, per_rank, sum_and_max, tally
from raywds.train.loop import EpochResult, evaluate, train_epoch
from raywds.train.mixup import Mix
from raywds.train.notice import Notice, Notices
from raywds.train.optim import lr_at, make_optimizer
from raywds.train.progress import ProgressLog, epoch_line
from raywds.train.state import check_unfinished, checkpoint_state, restore
from raywds.train.timing import stage_times
from raywds.world import World

log = logging.getLogger(__name__)

WAIT_PAST_DEADLINE_S = 30.0
"""After a preemption notice's checkpoint: how long past the deadline to wait for the node to go."""
MAX_WAIT_S = 600.0

# report(metrics, checkpoint): called on every rank after every epoch; checkpoint only on rank 0.
Report = Callable[[Metrics, dict[str, Any] | None], None]


class Trainer:
    """One rank's run: model, optimizer and data; the epoch keeper (raywds.train.epoch) owns the
    bookkeeping; `fit()` is the epoch loop."""

    def __init__(
        self,
        cfg: TrainConfig,
        world: World,
        report: Report | None,
        resume: dict[str, Any] | None,
        run_dir: RunDir | None = None,
        loaders: Loaders | None = None,
        manifest: Manifest | None = None,
        notices: Notices | None = None,
        apart: Report | None = None,
    ):
        torch.manual_seed(cfg.seed)
        self.cfg, self.world, self.run_dir, self.workers = cfg, world, run_dir, Workers(cfg, world)
        if run_dir is not None:  # first: a missing client refuses the run before any work
            check_trackers(cfg.trackers())
        self.tracking_ids = resume.get("tracking") if resume else None
        """The tracking runs a resumed checkpoint sent to, which the run folder's trackers continue."""
        self.loaders: Loaders = loaders if loaders is not None else PerRank()
        self.report = report if report is not None else (run_dir.save if run_dir is not None else None)
        self.keeper = EpochKeeper(cfg, world, manifest if manifest is not None else manifest_of(cfg))
        self.started = self.start_model(resume)
        self.compute = Compute.for_run(self.cfg, world.device)
        self.model = self.compute.model(self.started.model)
        self.wrapped: nn.Module = self.model
        if world.distributed:
            device_ids = [world.local_rank] if world.device.startswith("cuda") else None
            self.wrapped = DistributedDataParallel(self.model, device_ids=device_ids)
        if cfg.compile:
            self.wrapped = torch.compile(self.wrapped)  # type: ignore[assignment]
        cfg = self.cfg
        self.optimizer = make_optimizer(self.model, cfg, world, self.started.layer_scales(cfg.layer_decay))
        self.ema = ModelEma.for_run(self.model, cfg, world)
        if self.ema is not None and self.started.ema is not None:  # the --initial-checkpoint run's average
            self.ema.load_state_dict(self.started.ema)
        self.freeze = self.started.freeze() if cfg.freeze_epochs else None
        self.mix = Mix.for_run(cfg, len(self.manifest.classes))
        if resume is not None:
            restore(resume, self.model, self.optimizer, self.keeper, self.ema, self.started)
        self.notices = notices
        self.apart = apart
        """The report of an epoch whose validation is due and done apart from training (`raywds ray
        --async-validation`: a Ray task validates its checkpoint); None: the ranks validate it."""
        self.noticed: Notice | None = None
        self.redone = self.steps_redone() if resume is not None else 0
        self.metrics: Metrics = {}
        self.upcoming: tuple[Epoch, EpochLoader] | None = None
        """The next epoch, handed to the loader before this one's validation (`look_ahead`)."""

    def start_model(self, resume: dict[str, Any] | None) -> Start:
        """The model at step 0 (--pretrained, --initial-checkpoint; random when resuming, whose
        checkpoint restores it), and the config with the weights' preprocessing where not set."""
        cfg = self.cfg
        fresh = resume is None
        started = start_model(
            cfg.model,
            self.manifest.classes,
            pretrained=cfg.pretrained and fresh,
            initial_checkpoint=cfg.initial_checkpoint if fresh else None,
            storage=cfg.storage,
        )
        self.cfg = self.workers.asked = with_preprocessing(cfg, started.preprocessing)
        if self.world.is_main:
            for line in started.lines():
                log.info(line)
        return started

    @property
    def manifest(self) -> Manifest:
        """The manifest the current epoch trains on (the keeper's: an append seen on resume
        changes it at the next epoch)."""
        return self.keeper.manifest

    def fit(self) -> Metrics:
        """Train until cfg.epochs or cfg.max_steps; returns the last metrics (the same on every rank)."""
        try:
            self.start_run()
            while self.keeper.progress.epoch < self.cfg.epochs:
                if self.run_epoch(self.keeper.progress.epoch):
                    break
        finally:
            self.loaders.close()
        return self.metrics

    def start_run(self) -> None:
        """Plan the first epoch, start the run folder, then hand the epoch to the loader: the data,
        the model, the resume checkpoint and the plan are in hand before the folder's first write,
        so a run refused by any of them has written nothing into --out (raywds.runs.folder)."""
        index = self.keeper.progress.epoch
        first = self.plan(index) if index < self.cfg.epochs else None
        if self.run_dir is not None:
            self.run_dir.start(self.workers.asked, self.tracking_ids)
            if self.started.weights is not None:  # where the weights came from, beside the config
                self.run_dir.note("weights", json.dumps(self.started.record()))
        if first is not None:
            self.upcoming = first, self.hand(first)

    def plan(self, index: int) -> Epoch:
        """Plan epoch `index`; a plan that would hang is refused here."""
        self.cfg = cfg = self.workers.config(index)  # --loader-workers auto: the epoch's count, chosen now
        self.loader_cfg = cfg.loader(index)
        return self.keeper.begin(index, cfg)

    def hand(self, epoch: Epoch) -> EpochLoader:
        """Hand a planned epoch to the loader (its workers start making its batches)."""
        return self.loaders.train(
            self.manifest, self.loader_cfg, self.world, epoch.plan, epoch=epoch.index, position=epoch.position
        )

    def begin(self, index: int) -> tuple[Epoch, EpochLoader]:
        """Plan epoch `index` and hand it to the loader."""
        epoch = self.plan(index)
        return epoch, self.hand(epoch)

    def look_ahead(self, index: int) -> None:
        """Begin epoch `index` while the one before it validates and reports: its first batches
        are made by then. A plan refused here is refused again, after the report, by `run_epoch`."""
        most = self.cfg.max_steps
        if index >= self.cfg.epochs or (most is not None and self.keeper.progress.steps >= most):
            return
        try:
            self.upcoming = self.begin(index)
        except RaywdsError:
            self.upcoming = None

    def run_epoch(self, index: int) -> bool:
        """Train epoch `index` (or what is left of it), evaluate, report; True when max_steps stopped it."""
        upcoming, self.upcoming = self.upcoming, None
        epoch, batches = upcoming if upcoming is not None and upcoming[0].index == index else self.begin(index)
        cfg, world, keeper = self.cfg, self.world, self.keeper
        progress = ProgressLog(cfg, world, index, len(batches), run_dir=self.run_dir, first_step=epoch.start.steps)

        def after_step(step: int, batch: Batch, so_far: EpochResult) -> bool:
            keeper.mark(batch)
            if self.ema is not None and epoch.at_step_end(step):
                self.ema.after_step(self.model, epoch.start.optimizer_steps + step // epoch.accumulate, index)
            if self.run_dir is not None:
                self.run_dir.mark(epoch.steps)
            progress.update(step, so_far, keeper.lr(step), self.manifest.base)
            stop = keeper.stop_due(step)
            if stop or keeper.checkpoint_due(step):
                self.checkpoint_inside(epoch)
            elif self.notices is not None and keeper.notice_due(step):
                self.on_notice(epoch, self.notices())
            return stop

        try:
            result = train_epoch(
                self.wrapped,
                batches,
                self.optimizer,
                lambda step: keeper.lr(step + 1),  # `step` steps done: the rate of the next
                world,
                self.compute,
                uneven=keeper.uneven,
                label_smoothing=cfg.label_smoothing,
                after_step=after_step,
                where=f"in epoch {index + 1}",
                pg_timeout=cfg.pg_timeout,
                accumulate=epoch.accumulate,
                mix=functools.partial(self.mix, epoch=index) if self.mix is not None else None,
                freeze=self.freeze if index < cfg.freeze_epochs else None,
            )
        finally:
            progress.close()
        if result.stopped:
            return True
        self.finish_epoch(epoch, result)
        return cfg.max_steps is not None and keeper.progress.steps >= cfg.max_steps

    def checkpoint_inside(self, epoch: Epoch, notice: Notice | None = None) -> None:
        """Save the data position after this run's steps so far of the epoch (every rank, at the
        same step); one taken on a `notice` says so in its row."""
        here = self.keeper.inside()
        self.keeper.checkpointed(here)
        done = here.position.samples_done if here.position else 0
        if self.world.is_main:
            why = f" on a {notice.reason} notice" if notice is not None else ""
            log.info(
                f"step {here.steps}: checkpoint inside epoch {epoch.index + 1}{why} "
                f"({done}/{self.keeper.num_samples} samples done)"
            )
        row = checkpoint_row(epoch.index, here.steps, here.samples_seen, done)
        self.emit({**row, **(notice.row() if notice is not None else {})}, self.report)

    def on_notice(self, epoch: Epoch, notice: Notice | None) -> None:
        """A notice not seen before: checkpoint now. On a signal, stop (the process is going); on
        Ray's preemption notice, train no further step that a restart would train again: wait
        for the node to go (Ray restarts the run from this checkpoint), or, should it stay past
        the deadline, go on."""
        if notice is None or notice == self.noticed:
            return
        self.noticed = notice
        self.checkpoint_inside(epoch, notice)
        steps = self.keeper.progress.steps
        if notice.signum is not None:  # SIGTERM or SIGINT: the process is going
            where = self.run_dir.checkpoint_path if self.run_dir is not None else "the run folder's checkpoint"
            raise notice.stopped(
                f"at step {steps}, inside epoch {epoch.index + 1}, after a checkpoint: resume with --resume {where}"
            )
        left = max((notice.deadline or time.time()) - time.time(), 0.0)
        wait = min(left + WAIT_PAST_DEADLINE_S, MAX_WAIT_S)
        if self.world.is_main:
            nodes = ", ".join(notice.nodes)
            log.info(f"a preemption notice for node(s) {nodes}: waiting up to {wait:.0f} s for them to go")
        time.sleep(wait)
        if self.world.is_main:
            log.info("the node(s) stayed past the notice's deadline: training on")

    def steps_redone(self) -> int:
        """Rank 0, resumed: the steps the run had trained past the checkpoint it resumes (its
        run folder's last step), which it trains again; 0 elsewhere."""
        last = self.run_dir.last_step() if self.run_dir is not None else None
        return max(0, last - self.keeper.progress.steps) if last is not None else 0

    def finish_epoch(self, epoch: Epoch, result: EpochResult) -> None:
        cfg, world = self.cfg, self.world
        metrics = self.epoch_metrics(epoch, result)
        self.workers.measured(metrics)
        self.look_ahead(epoch.index + 1)
        # a train-only manifest trains without validation
        due = cfg.validates(epoch.index + 1) and "val" in self.manifest.splits
        if due and self.apart is None:
            batches = self.loaders.val(self.manifest, self.loader_cfg, world)
            ema = self.ema.same_on_every_rank(world) if self.ema is not None else None
            metrics.update(evaluate(self.model, batches, world, self.compute, ema=ema))
        if world.is_main:
            verdict = diagnose(metrics)[0]
            line = epoch_line(metrics, cfg.epochs, size=cfg.progressive_resize is not None)
            log.info(line + "\n  doctor: " + verdict)
            if self.run_dir is not None:
                self.run_dir.note("doctor", f"epoch {epoch.index + 1}: {verdict}")
        self.emit(metrics, self.apart if due and self.apart is not None else self.report)

    def epoch_metrics(self, epoch: Epoch, result: EpochResult) -> Metrics:
        """The job's numbers for the epoch, checked exact in split mode and against the bad-sample
        bound, job-wide (collectives: every rank calls this at its end)."""
        world, keeper = self.world, self.keeper
        sums = [result.num_samples, result.loss_sum, len(result.bad_samples), result.num_bad_shards]
        (num_samples, loss_sum, num_bad, bad_shards, retries, redone), seconds = sum_and_max(
            world, [*sums, result.num_read_retries, self.redone], result.seconds
        )
        self.redone = 0  # counted in the epoch the restart trained them in
        # Shards repeat within a resample epoch, and a bad sample with them: the bound is on the
        # distinct ones, job-wide. Every rank sees the same sum, so all gather or none does.
        mine = [list(b) for b in result.distinct_bad.values()]
        distinct = {(b[0], b[1]): BadSample(*b) for b in gathered(world, mine)} if num_bad else {}
        if len(distinct) > epoch.bad_allowed:
            named = list(result.distinct_bad.values()) or list(distinct.values())  # this rank's own, where it has one
            raise keeper.too_many_bad(named, int(num_bad), "across ranks", len(distinct))
        ranks = per_rank(
            world, [result.num_samples / max(result.seconds, 1e-9), result.data_wait_s / max(result.seconds, 1e-9)]
        )
        counted = tally(epoch.ledger, world, epoch.position)
        keeper.check_exact(counted)
        progress = keeper.finish(int(num_samples), int(num_bad), len(distinct))
        row = EpochRow(
            kind="epoch",
            epoch=epoch.index + 1,
            step=progress.steps,
            train_loss=loss_sum / max(num_samples, 1),
            train_samples=int(num_samples),
            samples_seen=progress.samples_seen,
            bad_samples=int(num_bad),
            bad_samples_total=progress.bad_samples,
            bad_samples_distinct=len(distinct),
            bad_samples_distinct_total=progress.bad_samples_distinct,
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
            steps_redone=int(redone),
            optimizer_steps=epoch.optimizer_steps(epoch.plan.max_batches),
            global_batch=self.cfg.global_batch or epoch.batch_samples,
            image_size_px=result.image_px or self.cfg.train_size(epoch.index),
        )
        return {**row}

    def emit(self, metrics: Metrics, report: Report | None) -> None:
        self.metrics = metrics
        if report is not None:
            report(metrics, self.state() if self.world.is_main else None)

    def state(self) -> dict[str, Any]:
        return {
            **checkpoint_state(self.model, self.optimizer, self.keeper, self.workers.asked, self.ema),
            "weights": self.started.record(),
        }


def train(
    cfg: TrainConfig,
    world: World,
    report: Report | None = None,
    resume: dict[str, Any] | None = None,
    *,
    run_dir: RunDir | None = None,
    loaders: Loaders | None = None,
    manifest: Manifest | None = None,
    notices: Notices | None = None,
    apart: Report | None = None,
) -> Metrics:
    """Train for cfg.epochs (or cfg.max_steps), from `resume` (a checkpoint's state) or cfg.resume;
    returns the last metrics, the same on every rank. Rank 0's `run_dir` gets progress rows and is the report
    unless `report` is given; `loaders`: where batches come from; `manifest`: cfg.data's, where known;
    `notices`: asked every --notice-every steps (raywds.train.notice); `apart`: the report of the
    epochs whose validation is done apart from the ranks, which then do not validate."""
    if resume is None and cfg.resume:
        resume = load_checkpoint(cfg.resume)
        check_unfinished(resume, cfg)
    return Trainer(cfg, world, report, resume, run_dir, loaders, manifest, notices, apart).fit()
