"""Where training is in its data: the epoch, the step, and in split mode which samples the
epoch has already delivered, so a resumed job trains on exactly the rest.

Every batch carries its samples' ids (shard offset in manifest order + place in the shard).
The loop marks them in a `Ledger` only after the optimizer step, so batches that DataLoader
workers prefetched, or that sat in a shuffle buffer, are not counted as seen.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raywds.data.columns import sample_counts
from raywds.data.manifest import Manifest, ShardInfo
from raywds.errors import ConfigError
from raywds.plan.epoch import Done
from raywds.plan.modes import Mode, parse

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Position:
    """A point inside an epoch that training can resume from. Its size does not grow with the
    samples: a count per training shard, and a flag per sample only for the shards in flight."""

    mode: Mode
    epoch: int
    """The epoch in progress (0-based)."""
    step: int
    """Steps every rank has taken in this epoch."""
    samples_done: int
    """Samples the whole job has trained on in this epoch."""
    shards_done: np.ndarray | None
    """split mode: the samples of each training shard (manifest order) this epoch delivered."""
    partial: dict[int, np.ndarray] = field(default_factory=dict)
    """split mode: for each shard (its index in manifest order) partly delivered, a bool per sample."""
    dataset: str
    """The training split's fingerprint; resuming on other shards is refused."""

    @classmethod
    def of_flags(cls, consumed: np.ndarray | None, shards: Sequence[ShardInfo], **fields: Any) -> Position:
        """A position from one flag per sample of the split (`consumed`; None in resample mode)."""
        if consumed is None:
            return cls(shards_done=None, **fields)
        done, partial = per_shard(consumed, shards)
        return cls(shards_done=done, partial=partial, **fields)

    def done(self) -> Done:
        """What a plan needs of this position: the samples done, and in split mode per shard."""
        per = None if self.shards_done is None else tuple(int(n) for n in self.shards_done)
        return Done(self.samples_done, per)

    def to_state(self) -> dict[str, Any]:
        done = None if self.shards_done is None else self.shards_done.astype("<i8").tobytes()
        return {
            "mode": self.mode.name,
            "epoch": self.epoch,
            "step": self.step,
            "samples_done": self.samples_done,
            "shards_done": done,
            "partial": {i: (len(f), np.packbits(f).tobytes()) for i, f in self.partial.items()},
            "dataset": self.dataset,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Position:
        fields = {k: state[k] for k in ("epoch", "step", "samples_done", "dataset")}
        fields["mode"] = parse(state["mode"])
        done = None if state["shards_done"] is None else np.frombuffer(state["shards_done"], dtype="<i8").copy()
        partial = {
            int(i): np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=n).astype(bool)
            for i, (n, bits) in state["partial"].items()
        }
        return cls(shards_done=done, partial=partial, **fields)

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


def per_shard(consumed: np.ndarray, shards: Sequence[ShardInfo]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """One flag per sample of the split -> the samples done per shard, and the flags of the
    shards partly done."""
    sizes = sample_counts(shards)
    ends = np.cumsum(sizes)
    running = np.concatenate([[0], np.cumsum(consumed, dtype=np.int64)])
    done = running[ends] - running[ends - sizes]
    partial = {
        int(i): consumed[ends[i] - sizes[i] : ends[i]].copy() for i in np.flatnonzero((done > 0) & (done < sizes))
    }
    return done, partial


def done_in(position: Position | None, epoch: int) -> Done | None:
    """What `epoch` delivered before `position`, for its plan; None when the epoch starts fresh."""
    if position is None or position.epoch != epoch or position.samples_done == 0:
        return None
    return position.done()


def already_done(
    position: Position | None, epoch: int, shards: Sequence[ShardInfo]
) -> tuple[dict[str, np.ndarray], int]:
    """What `epoch` delivered before `position`, for a loader to leave out: the flags of the
    shards partly done, by shard name, and the job's
    samples done, which reseeds resample's draws; ({}, 0) when the epoch starts fresh."""
    if position is None or position.epoch != epoch:
        return {}, 0
    return {shards[i].name: flags for i, flags in position.partial.items()}, position.samples_done


LISTED = 20_000
"""Splits of up to this many shards are listed in each checkpoint, so that a resume on changed
data names the shard that changed; larger ones are kept as their fingerprint alone."""


def shard_entries(manifest: Manifest) -> dict[str, Any]:
    """Every split's shards as [name, samples, sha256] (or, past LISTED shards, the split's
    fingerprint), for a checkpoint to compare at resume."""
    return {
        split: [[s.name, s.num_samples, s.sha256] for s in shards]
        if len(shards) <= LISTED
        else {"fingerprint": manifest.fingerprint(split), "shards": len(shards)}
        for split, shards in manifest.splits.items()
    }


def check_same_shards(saved: dict[str, Any], manifest: Manifest) -> None:
    """Refuse to resume on a training split that changed since the checkpoint, naming what
    changed; a changed validation split only changes what top-1 means, so it is a warning."""
    now = shard_entries(manifest)
    for split in sorted(set(saved) | set(now)):
        before, after = saved.get(split, []), now.get(split, [])
        if isinstance(before, list) and isinstance(after, list):
            change = _first_change(before, after)
        else:
            change = None if before == after else f"fingerprint {_summary(before)}, now {_summary(after)}"
        if change is None:
            continue
        text = f"the {split} shards changed since the checkpoint: {change}"
        if split == "train":
            raise ConfigError(f"{text}; resume with the data the run started on, or start a new run")
        log.warning("%s; validation numbers before and after this resume are not comparable", text)


def grown(saved: dict[str, Any], manifest: Manifest) -> int | None:
    """Where the training shards are the checkpoint's with more after them (an append,
    `raywds convert --append`) and the other splits the same or grown alike: how many training
    shards the checkpoint had; else None (unchanged, or changed otherwise: `check_same_shards`)."""
    now = shard_entries(manifest)
    if set(saved) - set(now) or not all(isinstance(v, list) for v in (*saved.values(), *now.values())):
        return None  # (past LISTED shards only fingerprints are kept: a grown split is a changed one)
    if any(now[split][: len(before)] != before for split, before in saved.items()):
        return None
    before = saved.get("train", [])
    return len(before) if len(now.get("train", [])) > len(before) else None


def _summary(entries: Any) -> str:
    if isinstance(entries, dict):
        return f"{entries['fingerprint']} ({entries['shards']:,} shards)"
    return f"of {len(entries):,} listed shards"


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
