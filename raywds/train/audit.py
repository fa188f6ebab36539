"""With `--audit-dir`: the id of every sample trained on, kept by each rank as it trains, and
the check (`raywds audit`) that every epoch trained on every sample exactly once.

A file per rank per segment, named by epoch, rank, attempt and segment:
`epoch0000-rank00001-from0000012-attempt1763900000000-at0000017-of0000120-pid42.ids` holds what
rank 1 trained in epoch 1 from global step 17 on, in the attempt that started from the checkpoint
at step 12 (at that time), out of a training split of 120 samples, as int64 sample ids
(little-endian; an id is the shard's offset in manifest order plus the sample's place in it).
Each checkpoint starts a segment: of an attempt, the segments that begin before the next
attempt's `from` are what that checkpoint holds; the others were redone.

An append adds shards after the split's others, so an epoch trained before it is checked against
the first shards, those that held its `of` samples, and its line says that an append came after.
(Files without `of`, from a raywds before it, are checked against the whole split.)
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from raywds.data.columns import sample_counts
from raywds.data.manifest import Manifest
from raywds.errors import DataError
from raywds.train.ledger import attempt_id
from raywds.world import World

NAME = re.compile(
    r"epoch(?P<epoch>\d+)-rank(?P<rank>\d+)-from(?P<from>\d+)-attempt(?P<attempt>\d+)-at(?P<at>\d+)"
    r"(?:-of(?P<of>\d+))?-pid(?P<pid>\d+)\.ids"
)


class Audit:
    """This rank's audit files (none without `audit_dir`)."""

    def __init__(self, audit_dir: str | None, world: World, start_step: int = 0):
        self.dir = Path(audit_dir) if audit_dir else None
        self.rank = world.rank
        self.start = self.at = start_step
        self.attempt = attempt_id(world) if self.dir is not None else 0
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def segment(self, step: int) -> None:
        """A checkpoint after global step `step`: later ids go to a new file."""
        self.at = step

    def write(self, epoch: int, ids: torch.Tensor, of: int) -> None:
        """`ids` trained on in `epoch`, whose plan covers a training split of `of` samples."""
        if self.dir is not None:
            name = (
                f"epoch{epoch:04d}-rank{self.rank:05d}-from{self.start:07d}-attempt{self.attempt}"
                f"-at{self.at:07d}-of{of:07d}-pid{os.getpid()}.ids"
            )
            with (self.dir / name).open("ab") as f:
                f.write(ids.numpy().astype("<i8").tobytes())


def kept(audit_dir: Path) -> dict[int, list[Path]]:
    """By epoch (0-based), the files the run's final line of checkpoints holds: of each attempt
    (the files that share `from` and `attempt`, in that order), the segments that begin before
    the next attempt's `from`; what an attempt trained after that checkpoint was redone."""
    files = [(m, f) for f in audit_dir.glob("*.ids") if (m := NAME.fullmatch(f.name))]
    attempts = sorted({(int(m["from"]), int(m["attempt"])) for m, _ in files})
    out: dict[int, list[Path]] = defaultdict(list)
    for m, f in sorted(files, key=lambda mf: mf[1].name):
        later = attempts[attempts.index((int(m["from"]), int(m["attempt"]))) + 1 :]
        if not later or int(m["at"]) < later[0][0]:
            out[int(m["epoch"])].append(f)
    return dict(out)


def trained(files: list[Path]) -> np.ndarray:
    """The sample ids in `files`, in order."""
    return np.concatenate([np.fromfile(f, dtype="<i8") for f in files] or [np.zeros(0, np.int64)])


@dataclass(frozen=True)
class EpochCheck:
    epoch: int
    """1-based, as the progress lines count."""
    samples: int
    repeated: int
    """Samples trained on more than once."""
    missing: int
    first_problem: str | None
    """The first sample repeated or missing: its shard and place, how often it was trained on."""
    appended: int = 0
    """Samples an append added to the split after this epoch (it is checked against those before)."""

    @property
    def line(self) -> str:
        if self.first_problem is None:
            said = f"epoch {self.epoch}: {self.samples} samples, each once"
        else:
            said = f"epoch {self.epoch}: {self.repeated} repeated, {self.missing} missing; first, {self.first_problem}"
        return said + (f" (before an append added {self.appended} samples)" if self.appended else "")


def planned_over(epoch: int, files: list[Path]) -> int | None:
    """The training split's size `epoch`'s files say its plan covered (None: files without it)."""
    sizes = {int(m["of"]) for f in files if (m := NAME.fullmatch(f.name)) and m["of"] is not None}
    if len(sizes) > 1:
        raise DataError(
            f"the audit files of epoch {epoch + 1} say it trained over {sorted(sizes)} samples: one epoch, one split"
        )
    return sizes.pop() if sizes else None


def as_it_was(manifest: Manifest, of: int | None, epoch: int) -> Manifest:
    """The training split as epoch `epoch` had it: its first shards holding `of` samples."""
    sizes = sample_counts(manifest.shards("train"))
    if of is None or of == int(sizes.sum()):
        return manifest
    ends = np.cumsum(sizes)
    count = int(np.searchsorted(ends, of)) + 1
    if of > int(ends[-1]) or int(ends[count - 1]) != of:
        raise DataError(
            f"epoch {epoch + 1} trained over a training split of {of} samples, and no first shards of this one "
            f"({int(ends[-1])} samples) hold that many: audit with the run's own --data"
        )
    return manifest.first("train", count)


def check_epoch(epoch: int, files: list[Path], manifest: Manifest) -> EpochCheck:
    """Count `files` against the training split (as it was when the epoch trained, `as_it_was`):
    a 16-bit count per sample, one epoch at a time."""
    whole = manifest.num_samples("train")
    manifest = as_it_was(manifest, planned_over(epoch, files), epoch)
    shards = manifest.shards("train")
    sizes = sample_counts(shards)
    counts = np.zeros(int(sizes.sum()), dtype=np.uint16)
    for f in files:
        ids = np.fromfile(f, dtype="<i8")
        if len(ids) and (ids.min() < 0 or ids.max() >= len(counts)):
            raise DataError(f"{f} holds sample ids outside the {len(counts)} of the manifest's training split")
        np.add.at(counts, ids, 1)
    wrong = np.flatnonzero(counts != 1)
    problem = None
    if len(wrong):
        i = int(wrong[0])
        shard = int(np.searchsorted(np.cumsum(sizes), i, side="right"))
        place = i - int(np.cumsum(sizes)[shard] - sizes[shard])
        problem = f"sample {place} of {shards[shard].name} (id {i}) was trained on {counts[i]} times"
    return EpochCheck(
        epoch=epoch + 1,
        samples=int(counts.sum()),
        repeated=int((counts > 1).sum()),
        missing=int((counts == 0).sum()),
        first_problem=problem,
        appended=whole - len(counts),
    )


def audit(audit_dir: Path, manifest: Manifest, epochs: int | None = None) -> list[EpochCheck]:
    """Each epoch's check (the first `epochs`, else every epoch the files hold)."""
    by_epoch = kept(audit_dir)
    if not by_epoch:
        raise DataError(f"no audit files (epoch…-rank…-….ids) in {audit_dir}")
    last = epochs if epochs is not None else max(by_epoch) + 1
    return [check_epoch(e, by_epoch.get(e, []), manifest) for e in range(last)]
