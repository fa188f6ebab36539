"""Where training is in its data: the epoch, the step, and in split mode which samples the
epoch has already delivered, so a resumed job trains on exactly the rest.

Every batch carries its samples' ids (shard offset in manifest order + place in the shard).
The loop marks them in a `Ledger` only after the optimizer step, so batches that DataLoader
workers prefetched, or that sat in a shuffle buffer, are not counted as seen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from raywds.data.manifest import Manifest, ShardInfo
from raywds.errors import ConfigError
from raywds.plan.epoch import Done
from raywds.plan.modes import Mode, parse

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Position:
    """A point inside an epoch that training can resume from."""

    mode: Mode
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

    def consumed_per_shard(self, shards: list[ShardInfo]) -> list[int]:
        """Samples of each of the training split's `shards` (in manifest order) delivered so far."""
        assert self.consumed is not None
        counts, start = [], 0
        for shard in shards:
            counts.append(int(self.consumed[start : start + shard.num_samples].sum()))
            start += shard.num_samples
        return counts

    def done(self, shards: list[ShardInfo]) -> Done:
        """What a plan needs of this position: the samples done, and in split mode per shard."""
        per_shard = None if self.consumed is None else tuple(self.consumed_per_shard(shards))
        return Done(self.samples_done, per_shard)

    def to_state(self) -> dict[str, Any]:
        packed = None if self.consumed is None else np.packbits(self.consumed).tobytes()
        num = None if self.consumed is None else len(self.consumed)
        return {
            "mode": self.mode.name,
            "epoch": self.epoch,
            "step": self.step,
            "samples_done": self.samples_done,
            "consumed": packed,
            "num_samples": num,
            "dataset": self.dataset,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Position:
        consumed = None
        if state["consumed"] is not None:
            bits = np.unpackbits(np.frombuffer(state["consumed"], dtype=np.uint8), count=state["num_samples"])
            consumed = bits.astype(bool)
        return cls(
            mode=parse(state["mode"]),
            epoch=state["epoch"],
            step=state["step"],
            samples_done=state["samples_done"],
            consumed=consumed,
            dataset=state["dataset"],
        )

    def check_compatible(self, manifest: Manifest, mode: Mode) -> None:
        if self.dataset != manifest.fingerprint("train"):
            raise ConfigError(
                f"the checkpoint was taken on other training shards (fingerprint {self.dataset}, these are "
                f"{manifest.fingerprint('train')}); resume with the same --data, or start a new run"
            )
        if self.mode != mode and self.step > 0:
            raise ConfigError(
                f"the checkpoint stopped inside epoch {self.epoch + 1} in {self.mode.name} mode; resume it with --mode "
                f"{self.mode.name} (the mode may change at an epoch boundary)"
            )


def done_in(position: Position | None, epoch: int, manifest: Manifest) -> Done | None:
    """What `epoch` delivered before `position`, for its plan; None when the epoch starts fresh."""
    if position is None or position.epoch != epoch or position.samples_done == 0:
        return None
    return position.done(manifest.shards("train"))


def already_done(position: Position | None, epoch: int) -> tuple[np.ndarray | None, int]:
    """What `epoch` delivered before `position`, for a loader to leave out: (split mode's
    consumed flags or None, the job's samples done, which reseeds resample's draws); (None, 0)
    when the epoch starts fresh."""
    if position is None or position.epoch != epoch:
        return None, 0
    return position.consumed, position.samples_done


def shard_entries(manifest: Manifest) -> dict[str, list[list[Any]]]:
    """Every split's shards as [name, samples, sha256], for a checkpoint to compare at resume."""
    return {split: [[s.name, s.num_samples, s.sha256] for s in shards] for split, shards in manifest.splits.items()}


def check_same_shards(saved: dict[str, list[list[Any]]], manifest: Manifest) -> None:
    """Refuse to resume on a training split that changed since the checkpoint, naming what
    changed; a changed validation split only changes what top-1 means, so it is a warning."""
    now = shard_entries(manifest)
    for split in sorted(set(saved) | set(now)):
        change = _first_change(saved.get(split, []), now.get(split, []))
        if change is None:
            continue
        text = f"the {split} shards changed since the checkpoint: {change}"
        if split == "train":
            raise ConfigError(f"{text}; resume with the data the run started on, or start a new run")
        log.warning("%s; validation numbers before and after this resume are not comparable", text)


def _first_change(before: list[list[Any]], after: list[list[Any]]) -> str | None:
    old, new = {e[0]: e for e in before}, {e[0]: e for e in after}
    for name in [e[0] for e in before] + [e[0] for e in after]:
        if name not in new:
            return f"{name} is gone from the manifest"
        if name not in old:
            return f"{name} was added to the manifest"
        (_, n0, h0), (_, n1, h1) = old[name], new[name]
        if n0 != n1:
            return f"{name} had {n0} samples, now {n1}"
        if h0 != h1:
            return f"{name} had sha256 {h0[:12]}…, now {h1[:12]}…"
    if [e[0] for e in before] != [e[0] for e in after]:
        return "the shards are listed in another order (sample ids would change)"
    return None
