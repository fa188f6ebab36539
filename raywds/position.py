"""Where training is in its data: the epoch, the step, and in split mode which samples the
epoch has already delivered, so a resumed job trains on exactly the rest.

Every batch carries its samples' ids (shard offset in manifest order + place in the shard).
The loop marks them in a `Ledger` only after the optimizer step, so batches that DataLoader
workers prefetched, or that sat in a shuffle buffer, are not counted as seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from raywds.errors import ConfigError
from raywds.shards import Manifest
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
        t = torch.from_numpy(self.counts).to(world.device)
        dist.all_reduce(t)
        return t.cpu().numpy()


@dataclass(frozen=True, kw_only=True)
class Position:
    """A point inside an epoch that training can resume from."""

    mode: str
    epoch: int
    """The epoch in progress (0-based)."""
    step: int
    """Steps every rank has taken in this epoch."""
    samples_done: int
    """Samples the whole job has trained on in this epoch."""
    consumed: np.ndarray | None
    """split mode: one bool per sample of the split, True when this epoch delivered it."""
    dataset: str
    """The training split's fingerprint; resuming on other shards is refused."""

    def consumed_per_shard(self, manifest: Manifest) -> list[int]:
        assert self.consumed is not None
        counts, start = [], 0
        for shard in manifest.shards("train"):
            counts.append(int(self.consumed[start : start + shard.num_samples].sum()))
            start += shard.num_samples
        return counts

    def to_state(self) -> dict[str, Any]:
        packed = None if self.consumed is None else np.packbits(self.consumed).tobytes()
        num = None if self.consumed is None else len(self.consumed)
        return {
            "mode": self.mode, "epoch": self.epoch, "step": self.step, "samples_done": self.samples_done,
            "consumed": packed, "num_samples": num, "dataset": self.dataset,
        }  # fmt: skip

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Position:
        consumed = None
        if state["consumed"] is not None:
            bits = np.unpackbits(np.frombuffer(state["consumed"], dtype=np.uint8), count=state["num_samples"])
            consumed = bits.astype(bool)
        return cls(
            mode=state["mode"], epoch=state["epoch"], step=state["step"], samples_done=state["samples_done"],
            consumed=consumed, dataset=state["dataset"],
        )  # fmt: skip

    def check_compatible(self, manifest: Manifest, mode: str) -> None:
        if self.dataset != manifest.fingerprint("train"):
            raise ConfigError(
                f"the checkpoint was taken on other training shards (fingerprint {self.dataset}, these are "
                f"{manifest.fingerprint('train')}); resume with the same --data, or start a new run"
            )
        if self.mode != mode and self.step > 0:
            raise ConfigError(
                f"the checkpoint stopped inside epoch {self.epoch + 1} in {self.mode} mode; resume it with --mode "
                f"{self.mode} (the mode may change at an epoch boundary)"
            )
