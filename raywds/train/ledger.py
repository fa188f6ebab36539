"""Collectives over the job's ranks: the ledger of samples trained on, sums and per-rank tables.
Each is a collective where the job is distributed: every rank must call it at the same point.

Every batch carries its samples' ids (shard offset in manifest order + place in the shard).
The loop marks them in a `Ledger` only after the optimizer step, so batches that DataLoader
workers prefetched, or that sat in a shuffle buffer, are not counted as seen.
"""

from __future__ import annotations

import os
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
