"""One owner of an epoch's bookkeeping, for every trainer: which saved position applies to the
epoch, its plan (refused where it would hang), the ledger of what this rank trained on, the
audit files, when a checkpoint may be taken inside it, the exactness check at its end, the
bad-sample bound, the learning-rate clock, and the run's counters that survive a restart.

`raywds train` (raywds.train.trainer) and the Lightning DataModule (raywds.lightning) only drive
it, so the two cannot drift apart:

    keeper = EpochKeeper(cfg, world, manifest)
    keeper.load_state_dict(checkpoint["progress"])        # resuming: the keeper's own part of checkpoint.pt
    epoch = keeper.begin(index, cfg)                      # the plan of what is left of epoch `index`
    batches = train_loader(manifest, cfg.loader(index), world, epoch.plan, epoch=index,
                           position=epoch.position)
    for ran, batch in enumerate(batches, 1):
        set_lr(optimizer, keeper.lr(ran))                 # this step's rate: warm-up's first step learns
        ...                                               # forward, backward, optimizer.step()
        keeper.mark(batch)                                # after its step: ledger, audit, bad-sample bound
        if keeper.checkpoint_due(ran):                    # every rank still has batches
            keeper.checkpointed(keeper.inside())          # the position: a collective in split mode
            save(checkpoint_state(model, optimizer, keeper, cfg))   # the keeper's state under "progress"
    keeper.check_exact(tally(epoch.ledger, world, epoch.position))  # split mode: every sample once
    keeper.finish(samples)                                # the samples all ranks trained on this run

`checkpoint_state` (raywds.train.state) keeps `state_dict()` under one key, `progress`; the
Lightning DataModule hands it to Lightning as the DataModule's state.

A checkpoint inside an epoch is taken only while every rank still has batches (`checkpoint_due`):
in split mode the position is counted over all ranks (a collective), which a rank that ran out
cannot join.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from raywds.data.columns import sample_counts
from raywds.data.manifest import Manifest
from raywds.errors import DataError
from raywds.loader.stages import BadSample, Batch
from raywds.plan.checks import check_plan
from raywds.plan.epoch import EpochPlan
from raywds.plan.modes import epoch_plan, parse
from raywds.plan.position import Position, done_in
from raywds.train.audit import Audit
from raywds.train.config import TrainConfig
from raywds.train.ledger import Ledger, Tally, tally
from raywds.train.optim import lr_at
from raywds.world import World


@dataclass
class Progress:
    """The run's counters that survive a resume."""

    epoch: int = 0
    """Epochs finished."""
    steps: int = 0
    """Steps so far, counting each finished epoch as its longest rank's batches (the same on every
    rank: in split mode a rank that ran out early took fewer optimizer steps), an unfinished
    epoch's steps included."""
    samples_seen: int = 0
    """Samples trained on, all ranks."""
    position: Position | None = None
    """Inside an unfinished epoch: what it has delivered."""
    bad_samples: int = 0
    """Samples skipped as undecodable in the finished epochs (resample mode), once per draw."""
    bad_samples_distinct: int = 0
    """The distinct samples among them, counted by epoch: a sample bad in two epochs counts twice."""
    optimizer_steps: int = 0
    """Optimizer steps so far (the longest rank's, as `steps`): `steps` with --global-batch's
    accumulation, each counted on the world it ran on."""
    epoch_optimizer_steps: int = 0
    """Inside an unfinished epoch: its optimizer steps so far."""


@dataclass
class Epoch:
    """One run of (part of) an epoch on this rank: its plan, where it started, what it trained."""

    index: int
    plan: EpochPlan
    position: Position | None
    """Where a resumed epoch starts; None from its beginning."""
    start: Progress
    """The run's progress when this part of the epoch began."""
    ledger: Ledger
    batch_samples: int
    """Samples a batch step trains on all ranks (ranks x --batch-size)."""
    size: int
    """Samples in a whole epoch, for the learning-rate clock: the manifest's, or
    --batches-per-epoch's batches."""
    bad_allowed: int
    """Distinct undecodable samples the epoch may skip (resample mode; an exact epoch skips none)."""
    accumulate: int = 1
    """Batches a rank trains an optimizer step on (--global-batch)."""
    ran: int = 0
    """Batches this rank has trained in this run's part of the epoch."""
    samples: int = 0
    """Samples this rank trained on in this run's part of the epoch."""
    bad: dict[tuple[str, str], BadSample] = field(default_factory=dict)
    """Each distinct bad sample this rank skipped, (shard, key) -> the latest draw's."""
    bad_draws: int = 0
    finished: bool = False
    """This rank has trained every batch the plan gave it."""
    closed: bool = False
    """The epoch's end has been counted (then `left` is what it left undone, None when nothing)."""
    left: Position | None = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def exact(self) -> bool:
        """Every sample exactly once (split mode): what the epoch delivered is counted over ranks."""
        return self.plan.mode.exact

    @property
    def done_before(self) -> int:
        return self.position.samples_done if self.position else 0

    @property
    def step_before(self) -> int:
        return self.position.step if self.position else 0

    @property
    def step(self) -> int:
        """The epoch's steps so far, a resumed epoch's earlier ones included."""
        return self.step_before + self.ran

    @property
    def steps(self) -> int:
        """The run's steps so far."""
        return self.start.steps + self.ran

    @property
    def optimizer_steps_before(self) -> int:
        """A resumed epoch's optimizer steps before this run's part."""
        return self.start.epoch_optimizer_steps if self.position is not None else 0

    def optimizer_steps(self, ran: int) -> int:
        """The epoch's optimizer steps once this run's part has taken `ran` batches (a last,
        short step counted)."""
        return self.optimizer_steps_before + math.ceil(ran / self.accumulate)

    def at_step_end(self, ran: int) -> bool:
        """Whether this run's `ran`-th batch ends an optimizer step (a checkpoint is taken only there)."""
        return ran % self.accumulate == 0


class EpochKeeper:
    """The bookkeeping of a run's epochs on one rank; `state_dict()`/`load_state_dict()` carry
    its counters and the unfinished epoch's position through a checkpoint."""

    def __init__(self, cfg: TrainConfig, world: World, manifest: Manifest):
        self.cfg, self.world = cfg, world
        self.mode = parse(cfg.mode)
        self.use(manifest)
        self.later: Manifest | None = None
        """The grown manifest the next epoch trains on, where a resume across an append finishes
        the epoch it stopped in on the shards that epoch began with (`grew`)."""
        self.progress = Progress()
        self.epoch: Epoch | None = None
        self.audit: Audit | None = None

    def use(self, manifest: Manifest) -> None:
        """Plan the epochs from now on over `manifest`'s training shards."""
        self.manifest = manifest
        self.num_samples = manifest.num_samples("train")
        self.shard_sizes = sample_counts(manifest.shards("train"))

    def grew(self, state: dict[str, Any], shards_before: int) -> str:
        """Resume `state` on a manifest an append grew: its training shards after the first
        `shards_before` are new. An epoch the checkpoint stopped inside finishes on the shards it
        began with; the next trains on all. Returns what to say of it."""
        full, old = self.manifest, self.manifest.first("train", shards_before)
        self.use(old)
        self.load_state_dict(state)
        new = full.num_samples("train") - old.num_samples("train")
        epoch = self.progress.epoch + 1
        shards = len(full.shards("train")) - shards_before
        grown = (
            f"the data grew since the checkpoint (an append): {new} training samples in "
            f"{shards} new shard{'s' if shards > 1 else ''}"
        )
        if self.progress.position is None:
            self.use(full)
            return f"{grown}; epoch {epoch} trains on all of them"
        self.later = full
        return f"{grown}; epoch {epoch} finishes on the shards it began with, epoch {epoch + 1} trains on all"

    # -- Stateful --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counters and, inside an epoch, its position, as last recorded (`checkpointed`,
        `finish`, `record`)."""
        progress = self.progress
        position = progress.position
        return {
            "epoch": progress.epoch,
            "steps": progress.steps,
            "samples_seen": progress.samples_seen,
            "bad_samples": progress.bad_samples,
            "bad_samples_distinct": progress.bad_samples_distinct,
            "optimizer_steps": progress.optimizer_steps,
            "epoch_optimizer_steps": progress.epoch_optimizer_steps,
            "position": position.to_state() if position else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = Position.from_state(state["position"]) if state["position"] else None
        if position is not None:
            position.check_compatible(self.manifest, self.mode)
            if position.samples_done == 0:
                position = None
        self.progress = Progress(
            epoch=state["epoch"],
            steps=state["steps"],
            samples_seen=state["samples_seen"],
            position=position,
            bad_samples=state["bad_samples"],
            bad_samples_distinct=state["bad_samples_distinct"],
            optimizer_steps=state.get("optimizer_steps", state["steps"]),  # before --global-batch: one batch a step
            epoch_optimizer_steps=state.get("epoch_optimizer_steps", position.step if position else 0),
        )

    # -- an epoch --------------------------------------------------------------------------
    def begin(self, index: int, cfg: TrainConfig | None = None) -> Epoch:
        """Plan epoch `index` (or what a saved position left of it) under `cfg` (the epoch's own,
        where `--loader-workers auto` chose its count), and refuse a plan that would hang."""
        cfg = self.cfg = cfg or self.cfg
        world, start = self.world, self.progress
        position = start.position if start.position and start.position.epoch == index else None
        if self.later is not None and position is None:  # past the epoch a resume across an append finished
            self.use(self.later)
            self.later = None
        plan = epoch_plan(
            self.manifest, cfg, world.world_size, epoch=index, done=done_in(position, index),
            ranks_per_node=world.ranks_per_node,
        )  # fmt: skip
        check_plan(plan, self.manifest)
        accumulate = cfg.accumulation(world.world_size)
        batch_samples = world.world_size * cfg.batch_size
        size = cfg.batches_per_epoch * batch_samples if cfg.batches_per_epoch else self.num_samples
        bad_allowed = cfg.bad_samples_allowed(sum(plan.samples_per_rank))
        if self.audit is None:
            self.audit = Audit(cfg.audit_dir, world, start.steps)
        ledger = Ledger(self.shard_sizes)
        self.epoch = Epoch(index, plan, position, start, ledger, batch_samples, size, bad_allowed, accumulate)
        return self.epoch

    @property
    def uneven(self) -> bool:
        """Whether ranks may run out of batches at different steps (split mode): the loop then
        lets the ones done early shadow the collectives of the rest (Join)."""
        return self.current().exact

    def current(self) -> Epoch:
        assert self.epoch is not None, "begin() plans each epoch before its batches"
        return self.epoch

    def mark(self, batch: Batch) -> None:
        """A training batch this rank takes: its ids to the ledger and the audit, its skipped
        samples to the bound (a rank alone past it stops the run)."""
        epoch, audit = self.current(), self.audit
        epoch.ledger.mark(batch.ids)
        if audit is not None:
            audit.write(epoch.index, batch.ids, self.num_samples)
        epoch.ran += 1
        epoch.samples += len(batch.labels)
        epoch.bad_draws += len(batch.bad_samples)
        epoch.bad.update(((b.shard, b.key), b) for b in batch.bad_samples)
        if len(epoch.bad) > epoch.bad_allowed:
            raise self.too_many_bad(list(epoch.bad.values()), epoch.bad_draws, "on this rank")
        epoch.finished = epoch.ran >= epoch.plan.batches_per_rank[self.world.rank]

    def too_many_bad(self, bad: list[BadSample], draws: int, where: str, distinct: int | None = None) -> DataError:
        """The error past --max-bad-samples: the latest distinct bad sample's line, then the counts:
        the draws skipped and the distinct samples among them, which the bound is on."""
        last = f"{bad[-1].line} " if bad else ""
        distinct = len(bad) if distinct is None else distinct
        return DataError(
            f"{last}({draws} bad samples skipped this epoch {where}, {distinct} distinct: more "
            f"than the {self.current().bad_allowed} that --max-bad-samples {self.cfg.max_bad_samples:g} allows); "
            "run `raywds verify` on the shards"
        )

    def clock(self, ran: int) -> float:
        """Epochs done, fractional, once this run's `ran`-th step of the epoch is taken: the clock
        of the learning-rate schedule, the same on every rank at an epoch's boundaries."""
        epoch = self.current()
        return epoch.index + min((epoch.done_before + ran * epoch.batch_samples) / max(epoch.size, 1), 1.0)

    def lr(self, ran: int) -> float:
        """The learning rate of this run's `ran`-th step (1-based) of the epoch: warm-up's first step learns."""
        return lr_at(self.cfg, self.world, self.clock(ran))

    def checkpoint_due(self, ran: int) -> bool:
        """Whether to checkpoint after this run's `ran`-th step of the epoch (--checkpoint-every-steps),
        only where every rank is still in the loop and not at the epoch's last step (its own follows)."""
        epoch, every = self.current(), self.cfg.checkpoint_every_steps
        if every is None or ran > epoch.plan.min_batches or ran >= epoch.plan.max_batches:
            return False
        return (epoch.step_before + ran) % every == 0 and epoch.at_step_end(ran)

    def notice_due(self, ran: int) -> bool:
        """Whether every rank asks for a notice after this run's `ran`-th step of the epoch
        (--notice-every): a collective, so only where every rank is still in the loop, and not
        at the epoch's last step (its own checkpoint follows)."""
        epoch, every = self.current(), self.cfg.notice_every
        if every is None or ran > epoch.plan.min_batches or ran >= epoch.plan.max_batches:
            return False
        return ran % every == 0 and epoch.at_step_end(ran)

    def stop_due(self, ran: int) -> bool:
        """Whether --max-steps stops the run after this run's `ran`-th step of the epoch (a
        checkpoint is taken there: only where every rank is still in the loop)."""
        epoch, most = self.current(), self.cfg.max_steps
        reached = most is not None and epoch.start.steps + ran >= most
        return reached and ran <= epoch.plan.min_batches and epoch.at_step_end(ran)

    def inside(self) -> Progress:
        """The run's progress after this rank's steps so far, inside the epoch (a collective in
        split mode: every rank calls it at the same step)."""
        epoch = self.current()
        if epoch.exact:
            counted = tally(epoch.ledger, self.world, epoch.position, flags=True)
            return self._left(epoch, counted)
        return self._left(epoch, None)

    def _left(self, epoch: Epoch, counted: Tally | None) -> Progress:
        """The progress of an epoch stopped after `epoch.ran` steps: its position by `counted`
        (split mode), or by the batches, all full, that every rank took (resample)."""
        done = counted.distinct if counted is not None else epoch.done_before + epoch.ran * epoch.batch_samples
        here = Position(
            mode=epoch.plan.mode,
            epoch=epoch.index,
            step=epoch.step,
            samples_done=done,
            shards_done=counted.shards_done if counted is not None else None,
            partial=counted.partial if counted is not None else {},
            dataset=self.manifest.fingerprint("train"),
        )
        start, taken = epoch.start, epoch.optimizer_steps(epoch.ran)
        return Progress(
            epoch=epoch.index,
            steps=epoch.steps,
            samples_seen=start.samples_seen + done - epoch.done_before,
            position=here,
            bad_samples=start.bad_samples,
            bad_samples_distinct=start.bad_samples_distinct,
            optimizer_steps=start.optimizer_steps + taken - epoch.optimizer_steps_before,
            epoch_optimizer_steps=taken,
        )

    def checkpointed(self, progress: Progress) -> None:
        """A checkpoint inside the epoch holds `progress`: later audit ids go to a new file."""
        self.progress = progress
        if self.audit is not None:
            self.audit.segment(progress.steps)

    def check_exact(self, counted: Tally) -> None:
        """At a split epoch's end: every sample of the manifest trained on exactly once, over all ranks."""
        epoch = self.current()
        if epoch.exact and (counted.duplicates or counted.missing or counted.samples != self.num_samples):
            raise DataError(
                f"split epoch {epoch.index + 1} was not exact: {counted.samples} samples trained, "
                f"the manifest has {self.num_samples}; {counted.duplicates} repeated, {counted.missing} missing"
            )

    def finish(self, samples: int, bad: int = 0, bad_distinct: int = 0) -> Progress:
        """The epoch's end, every rank done: `samples` trained on all ranks, `bad` draws skipped and
        the `bad_distinct` samples among them. The next epoch starts from its beginning."""
        epoch = self.current()
        start, taken = epoch.start, epoch.optimizer_steps(epoch.plan.max_batches)
        self.progress = Progress(
            epoch=epoch.index + 1,
            steps=start.steps + epoch.plan.max_batches,
            samples_seen=start.samples_seen + samples,
            bad_samples=start.bad_samples + bad,
            bad_samples_distinct=start.bad_samples_distinct + bad_distinct,
            optimizer_steps=start.optimizer_steps + taken - epoch.optimizer_steps_before,
        )
        epoch.closed = True
        if self.audit is not None:
            self.audit.segment(self.progress.steps)
        return self.progress

    def stopped(self, counted: Tally | None) -> Progress:
        """The epoch left unfinished (a max-steps stop), after every rank counted it: where it stands."""
        epoch = self.current()
        progress = self._left(epoch, counted if epoch.exact else None)
        epoch.closed, epoch.left = True, progress.position
        self.progress = progress
        return progress

    def record(self) -> None:
        """Record where the run stands now, for a checkpoint taken at any step (Lightning's):
        inside an epoch, a collective in split mode, so every rank calls it."""
        self.progress = self.now()

    def now(self) -> Progress:
        """The run's progress at this moment (inside an epoch, a collective in split mode)."""
        epoch = self.epoch
        if epoch is None or epoch.closed:
            return self.progress
        if epoch.finished:  # the epoch's end (its validation): every rank has trained its share, the plan's
            return Progress(
                epoch=epoch.index + 1, steps=epoch.start.steps + epoch.plan.max_batches,
                samples_seen=epoch.start.samples_seen + sum(epoch.plan.samples_per_rank),
                bad_samples=self.progress.bad_samples,
                bad_samples_distinct=self.progress.bad_samples_distinct,
                optimizer_steps=epoch.start.optimizer_steps + epoch.optimizer_steps(epoch.plan.max_batches)
                - epoch.optimizer_steps_before,
            )  # fmt: skip
        return self.inside()
