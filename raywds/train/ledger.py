"""Collectives over the job's ranks: the ledger of samples trained on, sums, per-rank tables
and gathered rows of strings.
Each is a collective where the job is distributed: every rank must call it at the same point.

Every batch carries its samples' ids (shard offset in manifest order + place in the shard).
The loop marks them in a `Ledger` only after the optimizer step, so batches that DataLoader
workers prefetched, or that sat in a shuffle buffer, are not counted as seen.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from raywds.world import World


class Ledger:
    """How often this rank trained on each sample of the split in the current epoch."""

    def __init__(self, num_samples: int):
        self.counts = np.zeros(num_samples, dtype=np.int32)

    def mark(self, ids: torch.Tensor) -> None:
        np.add.at(self.counts, ids.numpy(), 1)

    def total(self, world: World) -> np.ndarray:
        """The counts summed over all ranks (a collective: every rank must call it at the same point)."""
        if not world.distributed:
            return self.counts.copy()
        t = torch.tensor(self.counts, device=world.device)  # a copy: all_reduce works in place
        dist.all_reduce(t)
        return t.cpu().numpy()


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
    """Every rank's `items` (rows of strings), on every rank, in rank order: one all_reduce of the
    sizes and one all_gather of the bytes, as tensors on the rank's device (no object collectives,
    which need the CUDA device set)."""
    if not world.distributed:
        return list(items)
    data = json.dumps(items).encode()
    sizes = [int(row[0]) for row in per_rank(world, [len(data)])]
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(mine, device=world.device) for _ in sizes]
    dist.all_gather(parts, mine.to(world.device))
    return [row for part, size in zip(parts, sizes) for row in json.loads(part[:size].cpu().numpy().tobytes())]


def attempt_id(world: World) -> int:
    """Rank 0's clock (ms) as this run began, the same on every rank (a collective): it tells a
    restarted run's audit files from those of the attempt before, even when both began at one step."""
    t = torch.tensor([time.time_ns() // 1_000_000], dtype=torch.int64, device=world.device)
    if world.distributed:
        dist.broadcast(t, 0)
    return int(t.item())


class Audit:
    """With `audit_dir`: the key of every sample trained on, in files named by epoch, rank, attempt
    and segment: `epoch0000-rank00001-from0000012-attempt1763900000000-at0000017-pid42.keys` holds
    what rank 1 trained in epoch 1 from global step 17 on, in the attempt that started from the
    checkpoint at step 12 (at that time). Each checkpoint starts a segment: of an attempt, the
    segments that begin before the next attempt's `from` are what that checkpoint holds; the
    others were redone."""

    def __init__(self, audit_dir: str | None, world: World, start_step: int = 0):
        self.dir = Path(audit_dir) if audit_dir else None
        self.rank = world.rank
        self.start = self.at = start_step
        self.attempt = attempt_id(world) if self.dir is not None else 0
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def segment(self, step: int) -> None:
        """A checkpoint after global step `step`: later keys go to a new file."""
        self.at = step

    def write(self, epoch: int, keys: list[str]) -> None:
        if self.dir is not None:
            name = (
                f"epoch{epoch:04d}-rank{self.rank:05d}-from{self.start:07d}-attempt{self.attempt}"
                f"-at{self.at:07d}-pid{os.getpid()}.keys"
            )
            with (self.dir / name).open("a") as f:
                f.write("".join(k + "\n" for k in keys))
