"""The ledger and its tally against the plain count it replaces (one int per sample of the split,
summed over ranks), on one process and on three gloo ranks: shards read by one rank (a split
epoch), by several (resample, or a fault), with repeats, and after a resume."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raywds.plan.position import Position
from raywds.plan.split import Split
from raywds.train.ledger import Ledger, tally
from raywds.world import World

SIZES = np.array([10, 10, 10, 5, 7, 12, 3, 9], dtype=np.int64)


class _Shard:
    def __init__(self, n: int):
        self.num_samples = n


def before_flags(rng: np.random.Generator) -> np.ndarray:
    """What a run before a resume trained on: some shards whole, some in part, some not at all."""
    flags = np.zeros(SIZES.sum(), dtype=bool)
    for start, n in zip(np.cumsum(SIZES) - SIZES, SIZES):
        kind = rng.integers(3)
        if kind == 1:
            flags[start : start + n] = True
        elif kind == 2:
            flags[start + rng.choice(n, size=rng.integers(1, n), replace=False)] = True
    return flags


def position_of(flags: np.ndarray) -> Position:
    shards = [_Shard(int(n)) for n in SIZES]
    return Position.of_flags(flags, shards, mode=Split(), epoch=0, step=1, samples_done=int(flags.sum()), dataset="")  # type: ignore[arg-type]


def marks(seed: int, ranks: int, shared: bool) -> list[np.ndarray]:
    """Each rank's sample ids: each shard read by one rank (`shared` False), or by any, with repeats."""
    rng = np.random.default_rng(seed)
    owner = rng.integers(ranks, size=len(SIZES))
    out: list[list[int]] = [[] for _ in range(ranks)]
    for shard, (start, n) in enumerate(zip(np.cumsum(SIZES) - SIZES, SIZES)):
        for rank in range(ranks) if shared else [owner[shard]]:
            picked = rng.choice(n, size=rng.integers(0, n + 1), replace=True)
            out[rank].extend((start + picked).tolist())
    return [np.array(rng.permutation(ids), dtype=np.int64) for ids in out]


def reference(rank_marks: list[np.ndarray], flags: np.ndarray | None) -> dict:
    counts = np.zeros(SIZES.sum(), dtype=np.int64)
    for ids in rank_marks:
        np.add.at(counts, ids, 1)
    if flags is not None:
        counts += flags
    done = np.add.reduceat(counts > 0, np.cumsum(SIZES) - SIZES)
    starts = np.cumsum(SIZES) - SIZES
    partial = {i: (counts[s : s + n] > 0).tolist() for i, (s, n) in enumerate(zip(starts, SIZES)) if 0 < done[i] < n}
    return {
        "samples": int(counts.sum()),
        "distinct": int((counts > 0).sum()),
        "duplicates": int(np.maximum(counts - 1, 0).sum()),
        "missing": int((counts == 0).sum()),
        "shards_done": done.tolist(),
        "partial": {str(k): v for k, v in partial.items()},
    }


def counted(rank_ids: np.ndarray, world: World, before: Position | None) -> dict:
    ledger = Ledger(SIZES)
    for batch in np.array_split(rank_ids, 5):  # in batches, as the loop marks them
        ledger.mark(torch.from_numpy(batch))
    t = tally(ledger, world, before, flags=True)
    assert t.exact
    return {
        "samples": t.samples,
        "distinct": t.distinct,
        "duplicates": t.duplicates,
        "missing": t.missing,
        "shards_done": t.shards_done.tolist(),
        "partial": {str(k): v.tolist() for k, v in sorted(t.partial.items())},
    }


def test_one_rank_counts_as_the_plain_count_does_with_and_without_a_resume() -> None:
    for seed in range(20):
        rng = np.random.default_rng(seed)
        ids = marks(seed, 1, shared=True)
        flags = before_flags(rng) if seed % 2 else None
        before = position_of(flags) if flags is not None else None
        assert counted(ids[0], World(), before) == reference(ids, flags), seed


def test_a_position_keeps_only_the_partial_shards_flags_and_round_trips() -> None:
    flags = before_flags(np.random.default_rng(3))
    position = position_of(flags)
    partial = [i for i, n in enumerate(SIZES) if 0 < flags[(np.cumsum(SIZES) - SIZES)[i] :][:n].sum() < n]
    assert sorted(position.partial) == partial and position.shards_done is not None
    assert position.shards_done.sum() == flags.sum() and len(position.shards_done) == len(SIZES)
    again = Position.from_state(position.to_state())
    assert again.shards_done is not None and again.shards_done.tolist() == position.shards_done.tolist()
    assert {i: f.tolist() for i, f in again.partial.items()} == {i: f.tolist() for i, f in position.partial.items()}


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=3, timeout=timedelta(seconds=60)
    )
    try:
        world, results = World(rank=rank, world_size=3), {}
        for seed, shared in ((0, False), (1, False), (2, True), (3, True)):
            flags = before_flags(np.random.default_rng(seed)) if seed % 2 else None
            before = position_of(flags) if flags is not None else None
            results[seed] = counted(marks(seed, 3, shared)[rank], world, before)
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_three_ranks_count_as_the_plain_count_does(tmp_path: Path) -> None:
    """Seeds 0-1: each shard read by one rank (a split epoch); 2-3: by every rank, with repeats
    (resample). Odd seeds resume from a position with whole, partial and untouched shards."""
    mp.start_processes(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=3, start_method="forkserver")
    for rank in range(3):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for seed, shared in ((0, False), (1, False), (2, True), (3, True)):
            flags = before_flags(np.random.default_rng(seed)) if seed % 2 else None
            assert results[str(seed)] == reference(marks(seed, 3, shared), flags), (rank, seed)
