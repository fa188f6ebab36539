"""Collectives over the job's ranks: the ledger of samples trained on and its tally, sums,
per-rank tables, gathered rows of strings or bytes, and the attempt's id.
Each is a collective where the job is distributed: every rank must call it at the same point.

Every batch carries its samples' ids (shard offset in manifest order + place in the shard).
The loop marks them in a `Ledger` only after the optimizer step, so batches that DataLoader
workers prefetched, or that sat in a shuffle buffer, are not counted as seen.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from raywds.plan.position import Position
from raywds.world import World

MULTI_LIMIT = 1 << 24
"""Samples of shards read by several ranks (resample mode) counted exactly, one int32 each,
all-reduced; beyond it a resample epoch's distinct count is an upper bound."""


class Ledger:
    """How often this rank trained on each sample in the current epoch, kept only for the shards
    it read: the rank's share of the epoch, not the whole split."""

    def __init__(self, sizes: np.ndarray):
        self.sizes = sizes
        """Samples of each training shard, in manifest order."""
        self.starts = np.cumsum(sizes) - sizes
        self.seen: dict[int, np.ndarray] = {}

    def mark(self, ids: torch.Tensor) -> None:
        where = ids.numpy().astype(np.int64)
        shard = np.searchsorted(self.starts, where, side="right") - 1
        for i in np.unique(shard).tolist():
            if i not in self.seen:
                self.seen[i] = np.zeros(self.sizes[i], dtype=np.int32)
            np.add.at(self.seen[i], where[shard == i] - self.starts[i], 1)


@dataclass(frozen=True)
class Tally:
    """The job's count of an epoch so far, over all ranks and the runs before a resume."""

    samples: int
    distinct: int
    duplicates: int
    missing: int
    shards_done: np.ndarray
    """Samples of each shard trained on at least once."""
    partial: dict[int, np.ndarray]
    """With `flags`: a bool per sample for each shard partly done."""
    exact: bool = True
    """False where shards read by many ranks were too many samples to count one by one."""


def tally(ledger: Ledger, world: World, before: Position | None, *, flags: bool = False) -> Tally:
    """Count the epoch over all ranks (a collective): one all_reduce of a (shards x 3) table, the
    samples of shards several ranks read (none in a split epoch that goes right), and with
    `flags` a gather of the shards in flight. `before`: the position this run resumed from."""
    sizes, n = ledger.sizes, len(ledger.sizes)
    earlier = before.shards_done if before is not None and before.shards_done is not None else np.zeros(n, np.int64)
    merged = {i: _with_earlier(c, i, before, sizes) for i, c in ledger.seen.items()}
    table = np.zeros((n, 3), dtype=np.int32)  # distinct, repeats, ranks that read the shard
    for i, c in merged.items():
        table[i] = ((c > 0).sum(), np.maximum(c - 1, 0).sum(), 1)
    table = _all_reduce(world, table)
    distinct, repeats = np.where(table[:, 2] == 0, earlier, table[:, 0]).astype(np.int64), table[:, 1].astype(np.int64)
    partial: dict[int, np.ndarray] = {}
    multi = np.flatnonzero(table[:, 2] > 1)
    exact = int(sizes[multi].sum()) <= MULTI_LIMIT
    if len(multi) and exact:  # several ranks read these shards: their counts, summed sample by sample
        counts = _all_reduce(
            world, np.concatenate([ledger.seen.get(int(i), np.zeros(sizes[i], np.int32)) for i in multi])
        )
        for i, c in zip(multi.tolist(), np.split(counts, np.cumsum(sizes[multi])[:-1])):
            c = _with_earlier(c, i, before, sizes)
            distinct[i], repeats[i] = (c > 0).sum(), np.maximum(c - 1, 0).sum()
            partial[i] = c > 0
    elif len(multi):
        distinct[multi] = np.minimum(distinct[multi], sizes[multi])
    if flags:
        partial = {i: f for i, f in partial.items() if 0 < distinct[i] < sizes[i]}
        mine = {i: c > 0 for i, c in merged.items() if table[i, 2] == 1 and 0 < distinct[i] < sizes[i]}
        for part in gathered_bytes(world, _pack(mine)):
            partial.update(_unpack(part, sizes))
        untouched = before.partial.items() if before is not None else ()
        partial.update({i: f for i, f in untouched if table[i, 2] == 0})
    return Tally(
        samples=int(distinct.sum() + repeats.sum()),
        distinct=int(distinct.sum()),
        duplicates=int(repeats.sum()),
        missing=int((sizes - distinct).sum()),
        shards_done=distinct,
        partial=partial if flags else {},
        exact=exact,
    )


def _with_earlier(counts: np.ndarray, i: int, before: Position | None, sizes: np.ndarray) -> np.ndarray:
    """A shard's counts this run plus what the run before a resume trained of it."""
    if before is None or before.shards_done is None or not before.shards_done[i]:
        return counts
    earlier = before.partial.get(i)
    return counts + (1 if earlier is None else earlier)  # a shard not in `partial` was done whole


def _all_reduce(world: World, array: np.ndarray) -> np.ndarray:
    if not world.distributed:
        return array
    t = torch.from_numpy(array).to(world.device)
    dist.all_reduce(t)
    return t.cpu().numpy()


def _pack(flags: dict[int, np.ndarray]) -> bytes:
    """Shards' flags as bytes: their count, their indices (int64), then each one's packed bits."""
    index = np.array(sorted(flags), dtype="<i8")
    return b"".join(
        [
            np.array([len(index)], dtype="<i8").tobytes(),
            index.tobytes(),
            *(np.packbits(flags[i]).tobytes() for i in index),
        ]
    )


def _unpack(data: bytes, sizes: np.ndarray) -> dict[int, np.ndarray]:
    count = int(np.frombuffer(data, dtype="<i8", count=1)[0])
    index = np.frombuffer(data, dtype="<i8", count=count, offset=8)
    out, at = {}, 8 * (1 + count)
    for i in index.tolist():
        size = (int(sizes[i]) + 7) // 8
        out[i] = np.unpackbits(np.frombuffer(data, dtype=np.uint8, count=size, offset=at), count=int(sizes[i])).astype(
            bool
        )
        at += size
    return out


def sum_and_max(world: World, total: list[float], longest: float) -> tuple[list[float], float]:
    if not world.distributed:
        return total, longest
    t = torch.tensor(total + [0.0], dtype=torch.float64, device=world.device)
    m = torch.tensor([longest], dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return t.tolist()[:-1], m.item()


def per_rank(world: World, values: list[float]) -> list[list[float]]:
    """Each rank's `values`, on every rank (one all_reduce of a ranks x values table)."""
    table = torch.zeros(world.world_size, len(values), dtype=torch.float64, device=world.device)
    table[world.rank] = torch.tensor(values, dtype=torch.float64)
    if world.distributed:
        dist.all_reduce(table)
    return table.tolist()  # type: ignore[no-any-return]


def gathered(world: World, items: list[list[str]]) -> list[list[str]]:
    """Every rank's `items` (rows of strings), on every rank, in rank order."""
    if not world.distributed:
        return list(items)
    return [row for part in gathered_bytes(world, json.dumps(items).encode()) for row in json.loads(part)]


def gathered_bytes(world: World, data: bytes) -> list[bytes]:
    """Every rank's `data`, on every rank, in rank order: one all_reduce of the sizes and one
    all_gather of the bytes, as tensors on the rank's device (no object collectives, which need
    the CUDA device set)."""
    if not world.distributed:
        return [data]
    sizes = [int(row[0]) for row in per_rank(world, [len(data)])]
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    parts = [torch.empty_like(mine, device=world.device) for _ in sizes]
    dist.all_gather(parts, mine.to(world.device))
    return [part[:size].cpu().numpy().tobytes() for part, size in zip(parts, sizes)]


def attempt_id(world: World) -> int:
    """Rank 0's clock (ms) as this run began, the same on every rank (a collective): it tells a
    restarted run's audit files from those of the attempt before, even when both began at one step."""
    t = torch.tensor([time.time_ns() // 1_000_000], dtype=torch.int64, device=world.device)
    if world.distributed:
        dist.broadcast(t, 0)
    return int(t.item())
