"""Split epochs at the scale of LAION-400M on thousands of ranks, simulated on synthetic
manifests: what a checkpoint all-reduces and keeps, what a loader worker is sent, how long a
resume plan takes, and that an epoch stopped and resumed on other world sizes trains every
sample exactly once through the loader's own stages. benchmarks/state_scale.py prints the
same measures as a table."""

from __future__ import annotations

import functools
import gc
import itertools
import pickle
import random
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from raywds.data.columns import ShardTable, table
from raywds.data.manifest import Manifest, ShardInfo
from raywds.errors import DataError
from raywds.loader.loader import drawn, train_stages
from raywds.loader.mixing import round_robin
from raywds.loader.stages import unconsumed, worker_shuffled
from raywds.plan.epoch import EpochPlan, Nodes
from raywds.plan.position import Position, already_done
from raywds.plan.resample import Resample
from raywds.plan.split import Split
from raywds.train.audit import audit
from raywds.train.config import TrainConfig
from raywds.train.ledger import Ledger, _pack, tally
from raywds.world import World

WORKERS = 8


@functools.cache
def synthetic(count: int, size: int | None = None) -> Manifest:
    """`count` shards of ~1,000 samples (or exactly `size`)."""
    rng = random.Random(count)
    shards = [
        ShardInfo(f"shard-{i:06d}.tar", size or rng.randint(950, 1050), 150_000_000, "0" * 64) for i in range(count)
    ]
    classes = [str(c) for c in range(1000)]
    return Manifest(base="https://shards.example/laion", classes=classes, splits={"train": shards})


def stopped(slots: list[list[ShardInfo]], sizes: np.ndarray, index: dict[str, int]) -> Position:
    """Every slot has read its first shard whole and half of its second: a checkpoint mid-epoch."""
    done = np.zeros(len(sizes), dtype=np.int64)
    partial = {}
    rng = np.random.default_rng(0)
    for slot in slots:
        for k, shard in enumerate(slot[:2]):
            i = index[shard.name]
            flags = np.ones(sizes[i], dtype=bool) if k == 0 else rng.random(sizes[i]) < 0.5
            done[i] = int(flags.sum())
            if k:
                partial[i] = flags
    return Position(
        mode=Split(), epoch=0, step=1, samples_done=int(done.sum()), shards_done=done, partial=partial, dataset=""
    )


def peak(work: Callable[[], object]) -> int:
    """Peak bytes Python allocated while `work` ran (traced apart from any timing: tracing slows it)."""
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(count: int, ranks: int, *, traced: bool = True) -> dict[str, float]:
    """A rank's costs at `count` shards on `ranks` x WORKERS slots, resumed from `stopped`
    (`traced`: also the peak memory of its plan and tally)."""
    manifest = synthetic(count)
    shards = manifest.shards("train")
    sizes = np.array([s.num_samples for s in shards], dtype=np.int64)
    index = {s.name: i for i, s in enumerate(shards)}
    cfg = TrainConfig(data=manifest.base, mode="split", loader_workers=WORKERS, batch_size=256)
    position = stopped(Split().plan(shards, num_ranks=ranks, num_workers=WORKERS, batch_size=256).slots, sizes, index)
    resume = {"num_ranks": ranks, "num_workers": WORKERS, "batch_size": 256, "done": position.done()}
    gc.collect()
    started = time.process_time()  # this process's CPU: other work on a busy machine does not count
    resumed = Split().plan(shards, **resume)  # type: ignore[arg-type]
    plan_s = time.process_time() - started
    plan_peak = peak(lambda: Split().plan(shards, **resume)) if traced else 0  # type: ignore[arg-type]
    ledger = Ledger(sizes)  # rank 0 trains on the rest of its slots' shards, then checkpoints
    starts = np.cumsum(sizes) - sizes
    for w in range(WORKERS):
        for shard in resumed.slot(0, w):
            i = index[shard.name]
            left = np.flatnonzero(~position.partial[i]) if i in position.partial else np.arange(sizes[i])
            for batch in np.array_split(starts[i] + left, max(1, len(left) // 256)):
                ledger.mark(torch.from_numpy(batch))
    started = time.perf_counter()
    counted = tally(ledger, World(), position, flags=True)
    tally_s = time.perf_counter() - started
    in_flight = {i: f for i, f in position.partial.items() if i in ledger.seen}
    stages, *_ = train_stages(manifest, cfg.loader(), 0, resumed, epoch=0, position=position)
    after = Position(
        mode=Split(), epoch=0, step=2, samples_done=counted.distinct, shards_done=counted.shards_done,
        partial=position.partial, dataset="",
    )  # fmt: skip
    return {
        "samples": int(sizes.sum()),
        "reduced": 3 * 4 * count,  # the tally's (shards x 3) int32 table
        "gathered": ranks * len(_pack(in_flight)),
        "state": len(pickle.dumps(after.to_state())),
        "worker": len(pickle.dumps(stages)),
        "plan_s": plan_s,
        "plan_peak": plan_peak,
        "tally_s": tally_s,
        "tally_peak": peak(lambda: tally(ledger, World(), position, flags=True)) if traced else 0,
    }


def test_a_resample_worker_is_sent_its_own_draws_only() -> None:
    """At 400,000 shards a resample worker gets the draws it can read this epoch, not the list."""
    manifest = synthetic(400_000)
    cfg = TrainConfig(data=manifest.base, loader_workers=WORKERS, batch_size=256)
    plan = Resample().plan(manifest.shards("train"), num_ranks=4096, num_workers=WORKERS, batch_size=256)
    stages, *_ = train_stages(manifest, cfg.loader(), 4095, plan, epoch=0)
    assert len(pickle.dumps(stages)) <= 1e6
    mine = drawn(plan, manifest.shards("train"), cfg, 4095, epoch=0)
    endless = Resample().shards_for(plan, manifest.shards("train"), rank=4095, worker=3, seed=cfg.seed, epoch=0)
    assert mine[3] == list(itertools.islice(endless, len(mine[3]))), "the draws the worker would make itself"
    per_worker = plan.max_batches * 256 / WORKERS
    assert sum(s.num_samples for s in mine[3]) >= 3 * per_worker, "room for what a worker reads, three times"


@pytest.mark.parametrize("mode", [Split(), Resample()])
def test_a_ranks_stages_from_the_manifests_columns_make_only_its_own_shards_records(
    mode: Split | Resample, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read from manifest.npz, the manifest is a ShardTable: a rank's loader stages, each epoch,
    look up the shards it reads (by the manifest's index) and never go through all 400,000
    records (about a second each time)."""
    listed = synthetic(400_000)
    manifest = Manifest(base=listed.base, classes=listed.classes, splits={"train": table(listed.shards("train"))})
    cfg = TrainConfig(data=manifest.base, loader_workers=WORKERS, batch_size=256)
    plan = mode.plan(manifest.shards("train"), num_ranks=4096, num_workers=WORKERS, batch_size=256)
    shards = manifest.shards("train")
    flags = {i: np.ones(shards[i].num_samples, dtype=bool) for i in range(0, 400_000, 97)}  # shards in flight
    position = Position(
        mode=mode, epoch=0, step=1, samples_done=1, shards_done=np.zeros(400_000), partial=flags, dataset=""
    )
    monkeypatch.setattr(ShardTable, "__iter__", lambda self: pytest.fail("went through every shard's record"))
    stages, *_ = train_stages(manifest, cfg.loader(), 4095, plan, epoch=0, position=position)
    assert len(pickle.dumps(stages)) <= 1e6


def test_a_resample_rank_whose_draws_run_out_stops_with_an_error_not_a_short_epoch() -> None:
    plan = Resample().plan(synthetic(20).shards("train"), num_ranks=2, num_workers=1, batch_size=8)
    with pytest.raises(DataError, match=r"rank 1: its loader workers' shard draws ran out after 3 of \d+ batches"):
        list(plan.mode.epoch_batches(iter(range(3)), plan, 1))


def test_a_laion_sized_epoch_on_4096_ranks_keeps_its_state_small_and_plans_in_seconds() -> None:
    small, big = measure(400_000, 512, traced=False), measure(400_000, 4096)
    assert big["samples"] > 399_000_000
    assert big["reduced"] <= 8e6 and big["gathered"] <= 8e6, big
    assert big["state"] <= 16e6, big
    assert big["worker"] <= 1e6 and small["worker"] <= 1e6, (small, big)
    assert big["plan_peak"] <= 64e6 and big["tally_peak"] <= 64e6, big
    assert big["plan_s"] < 2 * small["plan_s"] + 0.5, (small["plan_s"], big["plan_s"])  # a ratio: no machine flakes


def stream(plan: EpochPlan, shards: list[ShardInfo], position: Position | None, rank: int) -> Iterator[np.ndarray]:
    """Rank `rank`'s batches of sample ids as its loader gives them: each worker's shards in the
    plan's order, less what the position holds done (`unconsumed`), through the worker's shuffle,
    in batches; the DataLoader takes the workers' batches in turn."""
    sizes = [s.num_samples for s in shards]
    first = dict(zip((s.name for s in shards), (np.cumsum(sizes) - sizes).tolist()))
    whole = dict(zip((s.name for s in shards), sizes))  # a plan's shards count only what is left
    flags, _ = already_done(position, 0, shards)
    left_out = {name: (first[name], f) for name, f in flags.items()}
    workers = []
    for w in range(plan.num_workers):
        names = [s.name for s in plan.slot(rank, w)]
        samples = ({"__url__": n, "__id__": first[n] + k} for n in names for k in range(whole[n]))
        kept = worker_shuffled(unconsumed(samples, left_out), buffer=40, seed=1, epoch=0, rank=rank)
        workers.append(_batches((x["__id__"] for x in kept), plan.batch_size))
    yield from round_robin(workers)


def _batches(ids: Iterator[int], size: int) -> Iterator[np.ndarray]:
    chunk: list[int] = []
    for i in ids:
        chunk.append(i)
        if len(chunk) == size:
            yield np.array(chunk)
            chunk = []
    if chunk:
        yield np.array(chunk)


@pytest.mark.parametrize(("seed", "canonical"), [(0, 0), (1, 0), (2, 0), (3, 16)])
def test_an_epoch_stopped_and_resumed_on_other_worlds_trains_every_sample_once(
    seed: int, canonical: int, tmp_path: Path
) -> None:
    """2,000 shards x 50 samples on 64 x 8 slots, stopped at a seeded step, resumed on 48 x 4,
    stopped again, finished on 96 x 8: every sample once, counted by the ranks' ledgers; also
    with 16 canonical nodes (8 ranks a node: 8 nodes, then 6, then 12, none a divisor). Each
    rank also writes audit files as training does, with the two steps it took past each stop
    (lost with it, redone by the next attempt) in a later segment: `raywds audit` agrees."""
    manifest = synthetic(2000, size=50)
    shards = manifest.shards("train")
    sizes = np.array([s.num_samples for s in shards], dtype=np.int64)
    rng, position, start = random.Random(seed), None, 0
    for attempt, (ranks, workers, last) in enumerate(((64, 8, False), (48, 4, False), (96, 8, True))):
        done = position.done() if position is not None else None
        nodes = Nodes(canonical, ranks_per_node=8) if canonical else None
        plan = Split().plan(
            shards, num_ranks=ranks, num_workers=workers, batch_size=16, seed=seed, done=done, nodes=nodes
        )
        stop = None if last else rng.randint(1, plan.min_batches)
        ledger = Ledger(sizes)  # one for all ranks: their tally sums them
        for rank in range(ranks):
            for step, ids in enumerate(itertools.islice(stream(plan, shards, position, rank), stop and stop + 2)):
                # past the stop: a segment the next attempt redoes
                at = start if stop is None or step < stop else start + stop
                name = f"epoch0000-rank{rank:05d}-from{start:07d}-attempt{attempt}-at{at:07d}-pid1.ids"
                with (tmp_path / name).open("ab") as f:
                    f.write(ids.astype("<i8").tobytes())
                if stop is None or step < stop:
                    ledger.mark(torch.from_numpy(ids))
        counted = tally(ledger, World(), position, flags=True)
        assert counted.duplicates == 0, (ranks, counted.duplicates)
        start += stop or 0
        position = Position(
            mode=Split(), epoch=0, step=start, samples_done=counted.distinct,
            shards_done=counted.shards_done, partial=counted.partial, dataset="",
        )  # fmt: skip
    assert (counted.distinct, counted.missing, counted.samples) == (100_000, 0, 100_000)
    (check,) = audit(tmp_path, manifest)
    assert (check.samples, check.first_problem) == (100_000, None)
