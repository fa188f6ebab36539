"""The epoch keeper (raywds.train.epoch) on one rank, in process: fed batches of sample ids as a
one-rank loader makes them from the plan, it keeps the counters and the position a checkpoint
holds (under the checkpoint's `progress`, and back), says when a checkpoint, a notice or a stop is
due at an epoch's edges, keeps the learning-rate clock across a resume, finishes a resumed epoch
exactly, and finishes an epoch begun before an append on the shards it began with. The docstring's
loop is run as it is written, on real shards and the real loader."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from support.runs import small_config
from torch import nn

from raywds.data.manifest import Manifest, ShardInfo, read_manifest
from raywds.errors import ConfigError, DataError
from raywds.loader.loader import train_loader
from raywds.loader.stages import BadSample, Batch
from raywds.plan.modes import epoch_plan
from raywds.runs.checkpoint import load_checkpoint, save_checkpoint
from raywds.train.config import TrainConfig
from raywds.train.epoch import Epoch, EpochKeeper, Progress
from raywds.train.ledger import tally
from raywds.train.optim import set_lr
from raywds.train.state import check_unfinished, checkpoint_state, restore
from raywds.world import World

SIZES = [16] * 7 + [8]
"""The training shards: 120 samples, as the `shards` fixture cuts them; 8 batches of 16 an epoch."""


def manifest_of(sizes: list[int]) -> Manifest:
    shards = [ShardInfo(f"train-{i:03d}.tar", n, 1000 * n, f"{i:064x}") for i, n in enumerate(sizes)]
    return Manifest(base="/nowhere", classes=["a", "b"], splits={"train": shards})


def config(mode: str = "split", **overrides: object) -> TrainConfig:
    return small_config("/nowhere", mode=mode, loader_workers=1, epochs=2, **overrides)


def keeper_of(cfg: TrainConfig, sizes: list[int] = SIZES, world: World | None = None) -> EpochKeeper:
    return EpochKeeper(cfg, world or World(), manifest_of(sizes))


def batch_of(ids: list[int], bad: tuple[BadSample, ...] = ()) -> Batch:
    n = len(ids)
    images = torch.zeros(n, 3, 1, 1, dtype=torch.uint8)
    labels = torch.zeros(n, dtype=torch.int64)
    return Batch(images, labels, torch.tensor(ids, dtype=torch.int64), [f"k{i}" for i in ids], bad)


def batches(keeper: EpochKeeper, epoch: Epoch) -> list[Batch]:
    """This one rank's batches of `epoch`, as its loader makes them: in split mode its slot's
    samples not yet trained, in order; in resample mode full batches of drawn samples."""
    plan, size = epoch.plan, epoch.plan.batch_size
    if not epoch.exact:
        draw = random.Random(epoch.index)
        return [batch_of(draw.choices(range(keeper.num_samples), k=size)) for _ in range(plan.batches_per_rank[0])]
    index, first = keeper.manifest.index("train"), keeper.manifest.first_ids("train")
    partial = epoch.position.partial if epoch.position is not None else {}
    ids: list[int] = []
    for shard in plan.slot(0, 0):
        i = index[shard.name]
        done = partial.get(i, np.zeros(keeper.manifest.shards("train")[i].num_samples, dtype=bool))
        ids += [first[i] + j for j in np.flatnonzero(~done).tolist()]
    made = [batch_of(ids[at : at + size]) for at in range(0, len(ids), size)]
    assert len(made) == plan.batches_per_rank[0], "the plan's batch count"
    return made


def stopped_after(keeper: EpochKeeper, steps: int, index: int = 0) -> dict:
    """Train `steps` batches of epoch `index`, checkpoint there as the trainer does; the keeper's state."""
    epoch = keeper.begin(index)
    for batch in batches(keeper, epoch)[:steps]:
        keeper.mark(batch)
    keeper.checkpointed(keeper.inside())
    return keeper.state_dict()


def finish_epoch(keeper: EpochKeeper, index: int) -> Progress:
    """Train the rest of epoch `index`, check it exact and count it, as the trainer does."""
    epoch = keeper.begin(index)
    for batch in batches(keeper, epoch):
        keeper.mark(batch)
    keeper.check_exact(tally(epoch.ledger, keeper.world, epoch.position))
    return keeper.finish(epoch.samples)


@pytest.mark.parametrize("mode", ["split", "resample"])
def test_a_keepers_state_round_trips_through_a_new_keeper(mode: str) -> None:
    keeper = keeper_of(config(mode))
    state = keeper_of(config(mode)).state_dict()
    assert state == {
        "epoch": 0, "steps": 0, "samples_seen": 0, "bad_samples": 0, "bad_samples_distinct": 0,
        "optimizer_steps": 0, "epoch_optimizer_steps": 0, "position": None,
    }  # fmt: skip
    finish_epoch(keeper, 0)
    state = stopped_after(keeper, 3, index=1)
    first = 120 if mode == "split" else 128  # resample: 8 full batches of drawn samples
    assert {k: v for k, v in state.items() if k != "position"} == {
        "epoch": 1, "steps": 11, "samples_seen": first + 48, "bad_samples": 0, "bad_samples_distinct": 0,
        "optimizer_steps": 11, "epoch_optimizer_steps": 3,
    }  # fmt: skip
    position = state["position"]
    assert (position["mode"], position["epoch"], position["step"], position["samples_done"]) == (mode, 1, 3, 48)
    if mode == "split":  # the samples each shard delivered, and the flags of the ones in flight
        done = np.frombuffer(position["shards_done"], dtype="<i8")
        assert done.sum() == 48 and all(0 <= n <= size for n, size in zip(done, SIZES))
        partly = {i for i, n in enumerate(done) if 0 < n < SIZES[i]}
        assert set(position["partial"]) == partly
        for i, (count, bits) in position["partial"].items():
            assert count == SIZES[i] and np.unpackbits(np.frombuffer(bits, np.uint8), count=count).sum() == done[i]
    else:
        assert position["shards_done"] is None and position["partial"] == {}
    again = keeper_of(config(mode))
    again.load_state_dict(state)
    assert again.state_dict() == state
    assert again.progress.position is not None and again.progress.position.step == 3


def test_a_checkpoint_holds_the_keepers_state_in_one_place_and_a_resume_restores_it(tmp_path: Path) -> None:
    cfg = config()
    keeper = keeper_of(cfg)
    state = stopped_after(keeper, 5)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(checkpoint_state(model, optimizer, keeper, cfg), tmp_path / "checkpoint.pt")
    saved = load_checkpoint(str(tmp_path))  # weights_only: the position's arrays are kept as bytes
    assert set(saved) == {"model", "optimizer", "progress", "shards", "config", "classes"}
    assert saved["progress"] == state
    resumed = keeper_of(cfg)
    restore(saved, nn.Linear(2, 2), torch.optim.SGD(model.parameters(), lr=0.1), resumed)
    assert resumed.state_dict() == state
    check_unfinished(saved, dataclasses.replace(cfg, epochs=1))  # inside epoch 1: still to finish

    finish_epoch(resumed, 0)
    done = {**saved, "progress": resumed.state_dict()}
    with pytest.raises(ConfigError, match=r"has already trained 1 epochs, and --epochs is 1: nothing is left"):
        check_unfinished(done, dataclasses.replace(cfg, epochs=1))


def test_a_resumed_split_epoch_trains_exactly_what_is_left_then_counts_the_whole_epoch() -> None:
    state = stopped_after(keeper_of(config()), 3)
    keeper = keeper_of(config())
    keeper.load_state_dict(state)
    epoch = keeper.begin(0)
    assert epoch.position is not None and epoch.plan.resumed and epoch.plan.samples_per_rank == [72]
    assert (epoch.done_before, epoch.step_before, epoch.step) == (48, 3, 3)
    for ran, batch in enumerate(batches(keeper, epoch), 1):
        keeper.mark(batch)
        assert (epoch.ran, epoch.step, epoch.steps, epoch.finished) == (ran, 3 + ran, 3 + ran, ran == 5)
    counted = tally(epoch.ledger, keeper.world, epoch.position)
    assert (counted.samples, counted.distinct, counted.duplicates, counted.missing) == (120, 120, 0, 0)
    keeper.check_exact(counted)
    progress = keeper.finish(epoch.samples)
    assert progress == Progress(epoch=1, steps=8, samples_seen=120, optimizer_steps=8)
    assert keeper.state_dict()["position"] is None and keeper.begin(1).position is None

    again = keeper_of(config())
    again.load_state_dict(state)
    epoch = again.begin(0)
    twice = batches(again, epoch)
    for batch in [twice[0], *twice]:
        again.mark(batch)
    with pytest.raises(
        DataError,
        match=r"^split epoch 1 was not exact: 136 samples trained, the manifest has 120; 16 repeated, 0 missing$",
    ):
        again.check_exact(tally(epoch.ledger, again.world, epoch.position))


def test_a_saved_position_applies_to_its_own_epoch_only() -> None:
    keeper = keeper_of(config())
    keeper.load_state_dict(stopped_after(keeper_of(config()), 3))
    assert keeper.begin(1).position is None and keeper.begin(1).plan.samples_per_rank == [120]
    assert keeper.begin(0).position is not None

    empty = stopped_after(keeper_of(config()), 0)  # a position of nothing done is the epoch's start
    assert empty["position"] is not None and empty["position"]["samples_done"] == 0
    keeper = keeper_of(config())
    keeper.load_state_dict(empty)
    assert keeper.progress.position is None and keeper.begin(0).position is None


def due(keeper: EpochKeeper, epoch: Epoch, what: str) -> list[int]:
    """The steps (this run's, from 1) after which `what` is due, over the epoch's longest rank."""
    return [ran for ran in range(1, epoch.plan.max_batches + 1) if getattr(keeper, what)(ran)]


@pytest.mark.parametrize(
    "settings, resumed_at, checkpoints, notices, stops",
    [
        # Every 2 steps, never at the epoch's last (its own checkpoint follows); a stop may be there.
        (dict(checkpoint_every_steps=2, notice_every=2, max_steps=8), 0, [2, 4, 6], [2, 4, 6], [8]),
        (dict(checkpoint_every_steps=3, notice_every=3, max_steps=5), 0, [3, 6], [3, 6], [5, 6, 7, 8]),
        # Resumed after step 3: checkpoints on the epoch's steps (4, 6), notices on this run's (2, 4).
        (dict(checkpoint_every_steps=2, notice_every=2, max_steps=6), 3, [1, 3], [2, 4], [3, 4, 5]),
        (dict(checkpoint_every_steps=3, notice_every=3, max_steps=None), 2, [1, 4], [3], []),
        # --global-batch 32: a step is 2 batches; only a step's end may checkpoint, notice or stop.
        (dict(global_batch=32, checkpoint_every_steps=3, notice_every=3, max_steps=5), 0, [6], [6], [6, 8]),
        (dict(checkpoint_every_steps=None, notice_every=None, max_steps=None), 0, [], [], []),
    ],
)
def test_checkpoints_notices_and_stops_fall_due_inside_the_epoch(
    settings: dict, resumed_at: int, checkpoints: list[int], notices: list[int], stops: list[int]
) -> None:
    cfg = config(**settings)
    keeper = keeper_of(cfg)
    if resumed_at:
        keeper.load_state_dict(stopped_after(keeper_of(config()), resumed_at))
    epoch = keeper.begin(0)
    assert epoch.plan.max_batches == 8 - resumed_at
    assert due(keeper, epoch, "checkpoint_due") == checkpoints
    assert due(keeper, epoch, "notice_due") == notices
    assert due(keeper, epoch, "stop_due") == stops


def test_a_step_where_a_rank_has_run_out_is_never_due() -> None:
    """Two split ranks of 64 and 56 samples in batches of 8: 8 and 7 steps. After step 7 the
    shorter rank is done: no collective (a checkpoint's count, a notice, a stop's) may fall there."""
    cfg = config(batch_size=8, checkpoint_every_steps=1, notice_every=1, max_steps=8)
    keeper = keeper_of(cfg, world=World(rank=0, world_size=2))
    epoch = keeper.begin(0)
    assert epoch.plan.batches_per_rank == [8, 7] and keeper.uneven
    assert due(keeper, epoch, "checkpoint_due") == due(keeper, epoch, "notice_due") == [1, 2, 3, 4, 5, 6, 7]
    assert due(keeper, epoch, "stop_due") == []
    keeper = keeper_of(dataclasses.replace(cfg, max_steps=7), world=World(rank=0, world_size=2))
    assert due(keeper, keeper.begin(0), "stop_due") == [7]
    resample = keeper_of(config("resample"), world=World(rank=0, world_size=2))
    resample.begin(0)
    assert not resample.uneven


@pytest.mark.parametrize("mode, per_epoch", [("split", None), ("resample", None), ("resample", 4)])
def test_the_learning_rate_clock_runs_on_across_a_resume(mode: str, per_epoch: int | None) -> None:
    """The rate of every step is the same whether the epoch ran through or was stopped and resumed:
    the clock counts the samples the epoch had done before the resume."""
    cfg = config(mode, lr=0.1, warmup_epochs=0.5, batches_per_epoch=per_epoch)
    whole = keeper_of(cfg)
    steps = whole.begin(0).plan.max_batches
    rates = [whole.lr(ran) for ran in range(1, steps + 1)]
    assert whole.clock(0) == 0.0 and whole.clock(steps) == whole.clock(steps + 1) == 1.0
    size = 16 * (per_epoch or 7.5)  # the samples of an epoch: the manifest's, or --batches-per-epoch's
    assert rates[0] == pytest.approx(0.1 * (16 / size) / 0.5)  # warm-up's first step already learns
    assert max(rates) <= 0.1 and rates[-1] == pytest.approx(0.075)  # cosine, a third of the way down

    keeper = keeper_of(cfg)
    keeper.load_state_dict(stopped_after(keeper_of(cfg), 3))
    epoch = keeper.begin(0)
    assert [keeper.lr(ran) for ran in range(1, epoch.plan.max_batches + 1)] == rates[3:]
    finish_epoch(keeper, 0)
    keeper.begin(1)
    assert keeper.clock(0) == 1.0 and keeper.lr(0) == whole.lr(steps)


def test_an_epoch_stopped_before_an_append_finishes_on_its_shards_and_the_next_trains_on_all() -> None:
    cfg = config()
    state = stopped_after(keeper_of(cfg, SIZES[:6]), 2)
    keeper = keeper_of(cfg, SIZES)
    said = keeper.grew(state, 6)
    assert said == (
        "the data grew since the checkpoint (an append): 24 training samples in 2 new shards; "
        "epoch 1 finishes on the shards it began with, epoch 2 trains on all"
    )
    assert keeper.num_samples == 96 and keeper.state_dict() == state
    epoch = keeper.begin(0)
    assert epoch.plan.num_samples == 96 and epoch.plan.samples_per_rank == [64]
    progress = finish_epoch(keeper, 0)
    assert (progress.epoch, progress.steps, progress.samples_seen) == (1, 6, 96)
    epoch = keeper.begin(1)
    assert epoch.plan.num_samples == keeper.num_samples == 120 and epoch.plan.samples_per_rank == [120]
    assert len(keeper.manifest.shards("train")) == 8 and keeper.later is None
    finish_epoch(keeper, 1)

    between = keeper_of(cfg, SIZES[:7])  # stopped at an epoch's end: the next epoch trains on all
    finish_epoch(between, 0)
    keeper = keeper_of(cfg, SIZES)
    said = keeper.grew(between.state_dict(), 7)
    assert said == (
        "the data grew since the checkpoint (an append): 8 training samples in 1 new shard; "
        "epoch 2 trains on all of them"
    )
    assert keeper.num_samples == 120 and keeper.begin(1).plan.num_samples == 120


def test_the_bad_sample_bound_counts_distinct_samples_and_names_the_last() -> None:
    keeper = keeper_of(config("resample", max_bad_samples=1))
    epoch = keeper.begin(0)
    broken = [BadSample("train-003.tar", f"k{i}", f"k{i}.jpg", "cannot decode") for i in range(2)]
    keeper.mark(batch_of(list(range(16)), (broken[0],)))
    keeper.mark(batch_of(list(range(16)), (broken[0],)))  # drawn again: still one sample
    assert (epoch.bad_draws, len(epoch.bad), epoch.bad_allowed) == (2, 1, 1)
    with pytest.raises(DataError) as raised:
        keeper.mark(batch_of(list(range(16)), (broken[1],)))
    assert str(raised.value) == (
        "shard train-003.tar: sample k1 (k1.jpg): cannot decode (3 bad samples skipped this epoch on this rank, "
        "2 distinct: more than the 1 that --max-bad-samples 1 allows); run `raywds verify` on the shards"
    )
    assert config("resample").bad_samples_allowed(128) == keeper_of(config("resample")).begin(0).bad_allowed == 0
    assert keeper_of(config("resample", max_bad_samples=0.05)).begin(0).bad_allowed == 6  # of 128 drawn


def test_what_a_checkpoint_records_at_any_step_and_at_the_epochs_end() -> None:
    """`record` (Lightning's checkpoints): inside the epoch, its position; once this rank has
    trained its share, the epoch counted as done."""
    keeper = keeper_of(config("resample", global_batch=32))
    assert keeper.now() == Progress()
    epoch = keeper.begin(0)
    made = batches(keeper, epoch)
    for batch in made[:3]:
        keeper.mark(batch)
    keeper.record()
    inside = keeper.progress
    assert (inside.epoch, inside.steps, inside.samples_seen, inside.optimizer_steps) == (0, 3, 48, 2)
    assert inside.position is not None and inside.position.samples_done == 48
    for batch in made[3:]:
        keeper.mark(batch)
    assert epoch.finished
    keeper.record()
    assert keeper.progress == Progress(epoch=1, steps=8, samples_seen=128, optimizer_steps=4)  # the whole epoch
    progress = keeper.finish(128)
    assert progress == Progress(epoch=1, steps=8, samples_seen=128, optimizer_steps=4)
    assert keeper.now() is keeper.progress and epoch.closed


def test_a_stop_inside_an_epoch_leaves_its_position() -> None:
    keeper = keeper_of(config(global_batch=32))
    epoch = keeper.begin(0)
    for batch in batches(keeper, epoch)[:5]:
        keeper.mark(batch)
    progress = keeper.stopped(tally(epoch.ledger, keeper.world, epoch.position, flags=True))
    assert (progress.epoch, progress.steps, progress.samples_seen) == (0, 5, 80)
    assert (progress.optimizer_steps, progress.epoch_optimizer_steps) == (3, 3)  # the last, short one counted
    assert epoch.closed and epoch.left is progress.position and keeper.now() is progress
    assert progress.position is not None and progress.position.samples_done == 80


def test_the_docstring_loop_trains_a_split_epoch_exactly_across_a_checkpoint(shards: Path, tmp_path: Path) -> None:
    """raywds.train.epoch's docstring, run as written on one rank with the real loader: stopped at
    its first checkpoint, resumed from the checkpoint file, the epoch is every sample once."""
    cfg = small_config(shards, mode="split", loader_workers=0, epochs=2, checkpoint_every_steps=3)
    world, manifest, index = World(), read_manifest(str(shards)), 0
    model = nn.Sequential(nn.Flatten(), nn.LazyLinear(10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint: dict = {}

    def run(stop_at_checkpoint: bool) -> EpochKeeper:
        keeper = EpochKeeper(cfg, world, manifest)
        if checkpoint:
            keeper.load_state_dict(checkpoint["progress"])
        epoch = keeper.begin(index, cfg)
        loader_cfg = cfg.loader(index)
        batches = train_loader(manifest, loader_cfg, world, epoch.plan, epoch=index, position=epoch.position)
        for ran, batch in enumerate(batches, 1):
            set_lr(optimizer, keeper.lr(ran))
            loss = nn.functional.cross_entropy(model(batch.images.float()), batch.labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            keeper.mark(batch)
            if keeper.checkpoint_due(ran):
                keeper.checkpointed(keeper.inside())
                save_checkpoint(checkpoint_state(model, optimizer, keeper, cfg), tmp_path / "checkpoint.pt")
                if stop_at_checkpoint:
                    return keeper
        keeper.check_exact(tally(epoch.ledger, world, epoch.position))
        keeper.finish(epoch.samples)
        return keeper

    run(stop_at_checkpoint=True)
    checkpoint.update(load_checkpoint(str(tmp_path)))
    assert checkpoint["progress"]["position"]["samples_done"] == 48
    resumed = run(stop_at_checkpoint=False)
    assert resumed.progress == Progress(epoch=1, steps=8, samples_seen=120, optimizer_steps=8)
    assert optimizer.param_groups[0]["lr"] == resumed.lr(5) > 0


def test_a_keeper_asked_before_its_epoch_is_planned_says_so() -> None:
    keeper = keeper_of(config())
    with pytest.raises(AssertionError, match=r"^begin\(\) plans each epoch before its batches$"):
        keeper.current()
    one = keeper_of(config(batch_size=1), [1])  # an epoch of one sample: the clock still ends at 1
    one.begin(0)
    assert one.clock(1) == 1.0


def test_a_state_saved_before_optimizer_steps_were_counted_loads_one_batch_a_step() -> None:
    state = stopped_after(keeper_of(config()), 3)
    older = {k: v for k, v in state.items() if k not in ("optimizer_steps", "epoch_optimizer_steps")}
    keeper = keeper_of(config())
    keeper.load_state_dict(older | {"steps": 7})
    assert (keeper.progress.optimizer_steps, keeper.progress.epoch_optimizer_steps) == (7, 3)
    keeper.load_state_dict(older | {"steps": 7, "position": None})
    assert (keeper.progress.optimizer_steps, keeper.progress.epoch_optimizer_steps) == (7, 0)


def test_audit_files_are_cut_at_each_checkpoint_and_epoch(tmp_path: Path) -> None:
    cfg = config(audit_dir=str(tmp_path / "audit"))
    keeper = keeper_of(cfg)
    state = stopped_after(keeper, 3)
    finish_epoch(keeper, 0)
    keeper.mark(batches(keeper, keeper.begin(1))[0])
    resumed = keeper_of(cfg)
    resumed.load_state_dict(state)
    resumed.mark(batches(resumed, resumed.begin(0))[0])
    ids = {
        re.sub(r"-attempt\d+", "", re.sub(r"-pid\d+", "", f.name)): np.fromfile(f, dtype="<i8")
        for f in (tmp_path / "audit").iterdir()
    }
    assert {name: len(held) for name, held in ids.items()} == {
        "epoch0000-rank00000-from0000000-at0000000-of0000120.ids": 48,
        "epoch0000-rank00000-from0000000-at0000003-of0000120.ids": 72,
        "epoch0001-rank00000-from0000000-at0000008-of0000120.ids": 16,
        "epoch0000-rank00000-from0000003-at0000003-of0000120.ids": 16,
    }
    first = ids["epoch0000-rank00000-from0000000-at0000000-of0000120.ids"]
    rest = ids["epoch0000-rank00000-from0000000-at0000003-of0000120.ids"]
    assert sorted([*first, *rest]) == list(range(120))


def test_bad_samples_counted_at_epochs_ends_stay_counted_inside_the_next() -> None:
    keeper = keeper_of(config("resample"))
    keeper.begin(0)
    for batch in batches(keeper, keeper.current()):
        keeper.mark(batch)
    assert keeper.finish(128, bad=3, bad_distinct=2) == Progress(
        epoch=1, steps=8, samples_seen=128, bad_samples=3, bad_samples_distinct=2, optimizer_steps=8
    )
    state = stopped_after(keeper, 2, index=1)
    assert (state["bad_samples"], state["bad_samples_distinct"]) == (3, 2)
    again = keeper_of(config("resample"))
    again.load_state_dict(state)
    assert (again.progress.bad_samples, again.progress.bad_samples_distinct) == (3, 2)
    epoch = again.begin(1)
    for batch in batches(again, epoch):
        again.mark(batch)
    again.record()  # at the epoch's end, before it is counted
    assert (again.progress.bad_samples, again.progress.bad_samples_distinct) == (3, 2)
    progress = again.finish(96, bad=1, bad_distinct=1)
    assert (progress.bad_samples, progress.bad_samples_distinct, progress.samples_seen) == (4, 3, 128 + 32 + 96)


def test_a_checkpoint_inside_a_resumed_epoch_counts_both_parts() -> None:
    cfg = config(global_batch=32)  # a step is two batches: 8 batches, 4 steps
    keeper = keeper_of(cfg)
    keeper.load_state_dict(stopped_after(keeper_of(cfg), 2))
    assert keeper.progress.optimizer_steps == keeper.progress.epoch_optimizer_steps == 1
    epoch = keeper.begin(0)
    made = batches(keeper, epoch)
    for batch in made[:2]:
        keeper.mark(batch)
    here = keeper.inside()
    assert (here.steps, here.samples_seen, here.optimizer_steps, here.epoch_optimizer_steps) == (4, 64, 2, 2)
    assert here.position is not None and here.position.samples_done == 64
    assert here.position.shards_done is not None and int(here.position.shards_done.sum()) == 64
    for batch in made[2:]:
        keeper.mark(batch)
    keeper.record()
    assert keeper.progress == Progress(epoch=1, steps=8, samples_seen=120, optimizer_steps=4)


def test_a_split_position_counts_distinct_samples_and_a_resample_one_its_batches() -> None:
    keeper = keeper_of(config())
    epoch = keeper.begin(0)
    first = batches(keeper, epoch)[0]
    keeper.mark(first)
    keeper.mark(first)  # the same samples again: a split position counts them once
    assert keeper.inside().position.samples_done == 16  # type: ignore[union-attr]
    stopped = keeper.stopped(tally(epoch.ledger, keeper.world, epoch.position, flags=True))
    assert stopped.position is not None and stopped.position.samples_done == 16 and stopped.samples_seen == 16
    keeper = keeper_of(config("resample"))
    epoch = keeper.begin(0)
    keeper.mark(batch_of([0] * 16))
    keeper.mark(batch_of([0] * 16))  # resample draws repeat: its position is the batches taken
    stopped = keeper.stopped(tally(epoch.ledger, keeper.world, epoch.position, flags=True))
    assert stopped.position is not None and stopped.position.samples_done == 32 and stopped.samples_seen == 32


def test_the_plan_of_an_epoch_is_the_planners_for_that_epoch_and_world() -> None:
    cfg = config(canonical_nodes=2)
    world = World(rank=0, world_size=4, ranks_per_node=2)
    keeper = keeper_of(cfg, world=world)
    manifest = keeper.manifest
    for index in (0, 1):
        planned = epoch_plan(manifest, cfg, 4, epoch=index, ranks_per_node=2)
        assert keeper.begin(index).plan.slots.by_rank == planned.slots.by_rank
    other = [epoch_plan(manifest, cfg, 4, epoch=1, ranks_per_node=n).slots.by_rank for n in (1, 4)]
    assert keeper.begin(1).plan.slots.by_rank not in other
    assert keeper.begin(1).plan.slots.by_rank != epoch_plan(manifest, cfg, 4, epoch=0, ranks_per_node=2).slots.by_rank


def test_the_bound_names_the_latest_distinct_bad_sample_or_none() -> None:
    keeper = keeper_of(config("resample", max_bad_samples=2))
    keeper.begin(0)
    broken = [BadSample("train-003.tar", f"k{i}", f"k{i}.jpg", "cannot decode") for i in range(3)]
    keeper.mark(batch_of(list(range(16)), tuple(broken[:2])))
    with pytest.raises(DataError, match=r"^shard train-003\.tar: sample k2 \(k2\.jpg\): cannot decode \(3 bad"):
        keeper.mark(batch_of(list(range(16)), (broken[2],)))
    assert str(keeper.too_many_bad([], 9, "across ranks", 4)) == (
        "(9 bad samples skipped this epoch across ranks, 4 distinct: more than the 2 that --max-bad-samples 2 "
        "allows); run `raywds verify` on the shards"
    )
    assert "5 distinct" in str(keeper.too_many_bad(broken, 9, "across ranks", 5))
