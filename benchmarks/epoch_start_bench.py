"""Epoch starts with the run's loader workers kept (`PerRank`'s pools) against a fresh set of
workers each epoch (the loader before raywds.loader.pool), both driven by the real trainer.

    .venv/bin/python benchmarks/epoch_start_bench.py [--images DIR] [--copies 20] [--val-copies 4]
        [--repeats 2] [--epochs 4] [--batch 64] [--workers 2] [--shrink 8]

One process runs `raywds.train.trainer.train` (mode split, validation after every epoch, 224 px
crops, `--workers` loader workers, batch `--batch`, the `demo` network) on the same shards with
two `Loaders`, interleaved over `--repeats` repeats (the order alternating), one thread for
torch in the training process:

  pool   raywds.loader.loader.PerRank: one pool of workers for training and one for validation,
         kept for the whole run; the trainer hands epoch N+1 to the loader before epoch N
         validates (`Trainer.look_ahead`), so its workers make its first batches meanwhile
  fresh  `train_loader` and `val_loader` without a pool: every epoch and every validation pass
         forks its own workers when the trainer starts iterating it, and stops them at its end

Each epoch's batches are timed where the training loop receives them: the first batch's latency
(from the loop asking for it to its arrival: worker start, first shard reads, the shuffle
buffer's first fill, the first decode), the steady step (the median interval between the
arrivals of later batches: a training step plus whatever wait the loader adds), and the epoch's
images/s over its whole pass (the first ask to the last batch's step), against the steady-state
rate, batch / steady step (split mode's short last batch of each worker keeps a pass a percent
or two under it). Each validation pass is timed from the trainer asking for it to its last batch.

Rows: per epoch, the median over repeats; then epochs 2 and later pooled (epoch 1 starts its
workers either way): first batch / steady step (goal for pool: within 2x), epoch images/s pool
/ fresh, epoch images/s / steady-state rate (goal for pool: at least 0.95), validation pass
seconds, and the whole run's seconds.

On a CPU the demo network at 224 px takes seconds a step, so the loader's start would vanish
in the step: `--shrink K` average-pools the crops by K before the network (the loader still
makes, and hands over, 224 px crops), so that a step costs no more than the loader's batch and
the epoch start shows as it does on a GPU; `--shrink 1` trains the demo network as it is.

The shards: the photos in DIR (by default ../shared/data/imagenet-sample-100, real ImageNet
JPEGs) copied --copies times for the train split and --val-copies times for the val split,
converted by raywds into shards of 100 samples. The machine is shared and noisy: compare ratios
within one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from loader_bench import build_tree, photos

from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import Manifest
from raywds.loader.loader import EpochLoader, Loaders, PerRank, train_loader, val_loader
from raywds.loader.settings import LoaderConfig
from raywds.loader.stages import Batch
from raywds.models.start import Start, start_model
from raywds.plan.epoch import EpochPlan
from raywds.plan.position import Position
from raywds.train import trainer
from raywds.train.config import TrainConfig
from raywds.world import World

SIZE = 224
VARIANTS = ("pool", "fresh")


@dataclass
class Record:
    """One pass's times (time.perf_counter): handed to the loader, first asked for, each batch's arrival, its end."""

    kind: str
    epoch: int
    handed: float
    asked: float = float("nan")
    arrivals: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    end: float = float("nan")

    @property
    def first_s(self) -> float:
        return self.arrivals[0] - self.asked if self.arrivals else float("nan")

    @property
    def step_s(self) -> float:
        """The median interval between later batches' arrivals."""
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]
        return statistics.median(gaps) if gaps else float("nan")

    @property
    def rate(self) -> float:
        """Images/s over the whole pass, its first ask to its end."""
        return sum(self.sizes) / (self.end - self.asked)

    @property
    def seconds(self) -> float:
        return self.end - self.handed


def timed(batches: Iterable[Batch], record: Record) -> Iterator[Batch]:
    """`batches`, each arrival noted in `record`; the first ask is the first next() (a generator starts there)."""
    record.asked = time.perf_counter()
    it = iter(batches)
    try:
        for batch in it:
            record.arrivals.append(time.perf_counter())
            record.sizes.append(len(batch.labels))
            yield batch
    finally:
        if record.end != record.end:  # nan: not ended before
            record.end = time.perf_counter()
        close = getattr(it, "close", None)
        if close is not None:
            close()


class TimedEpoch(EpochLoader):
    """An epoch's loader whose batches are timed where the training loop receives them."""

    def __init__(self, inner: EpochLoader, record: Record):
        super().__init__(inner.batches, inner.plan, inner.rank)
        self.inner, self.record = inner, record

    def __iter__(self) -> Iterator[Batch]:
        return timed(self.inner, self.record)


class TimedVal:
    def __init__(self, inner: Iterable[Batch], record: Record):
        self.inner, self.record = inner, record

    def __iter__(self) -> Iterator[Batch]:
        return timed(self.inner, self.record)


class Fresh:
    """The loader before pools: workers of each pass's own, started as it is iterated, stopped at its end."""

    def train(
        self,
        manifest: Manifest,
        cfg: LoaderConfig,
        world: World,
        plan: EpochPlan,
        *,
        epoch: int,
        position: Position | None = None,
    ) -> EpochLoader:
        return train_loader(manifest, cfg, world, plan, epoch=epoch, position=position)

    def val(self, manifest: Manifest, cfg: LoaderConfig, world: World) -> Iterable[Batch]:
        return val_loader(manifest, cfg, world)

    def close(self) -> None:
        pass


class Timed:
    """`inner`'s loaders, every training epoch and validation pass timed into `records`."""

    def __init__(self, inner: Loaders):
        self.inner = inner
        self.records: list[Record] = []

    def train(
        self,
        manifest: Manifest,
        cfg: LoaderConfig,
        world: World,
        plan: EpochPlan,
        *,
        epoch: int,
        position: Position | None = None,
    ) -> EpochLoader:
        record = Record("train", epoch + 1, time.perf_counter())
        self.records.append(record)
        return TimedEpoch(self.inner.train(manifest, cfg, world, plan, epoch=epoch, position=position), record)

    def val(self, manifest: Manifest, cfg: LoaderConfig, world: World) -> Iterable[Batch]:
        record = Record("val", sum(r.kind == "val" for r in self.records) + 1, time.perf_counter())
        self.records.append(record)
        return TimedVal(self.inner.val(manifest, cfg, world), record)

    def close(self) -> None:
        self.inner.close()


def shrunk(factor: int) -> None:
    """The trainer's demo network behind an average pool of `factor` (1: the network as it is)."""

    def start(*args: Any, **kwargs: Any) -> Start:
        started = start_model(*args, **kwargs)
        if factor != 1:
            started.model = nn.Sequential(nn.AvgPool2d(factor), started.model)
        return started

    trainer.start_model = start


def run(variant: str, cfg: TrainConfig) -> tuple[list[Record], float]:
    """One whole run of `cfg` with `variant`'s loaders: its records and its seconds."""
    loaders = Timed(PerRank() if variant == "pool" else Fresh())
    start = time.perf_counter()
    trainer.train(cfg, World(), loaders=loaders)
    return loaders.records, time.perf_counter() - start


def median(values: Iterable[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    )
    parser.add_argument("--copies", type=int, default=20, help="train copies of each photo (default %(default)s)")
    parser.add_argument("--val-copies", type=int, default=4, help="val copies of each photo (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="loader workers (default %(default)s)")
    parser.add_argument("--shard-size", type=int, default=100, help="samples per shard (default %(default)s)")
    parser.add_argument(
        "--shrink", type=int, default=8, help="average-pool the crops by this before the network (default %(default)s)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # the training process's one thread; the loader workers take the other cores
    shrunk(args.shrink)
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="rwesb-") as tmp:
        work = Path(tmp)
        images = photos(args.images, work / "generated")
        count = build_tree(images, args.copies, work / "tree")
        val_count = build_tree(images, args.val_copies, work / "val")
        shutil.move(work / "val" / "train", work / "tree" / "val")
        shards = work / "shards"
        convert(work / "tree", shards, ConvertOptions(maxcount=args.shard_size, seed=0, workers=cores))
        cfg = TrainConfig(
            data=str(shards),
            model="demo",
            mode="split",
            epochs=args.epochs,
            batch_size=args.batch,
            image_size=SIZE,
            loader_workers=args.workers,
            val_every=1,
            out=str(work / "runs"),
        )
        kind = "generated" if images[0].is_relative_to(work) else "real ImageNet"
        num_train = len(list(shards.glob("*-train-*.tar")))
        num_val = len(list(shards.glob("*-val-*.tar")))
        print(
            f"{count} train samples in {num_train} shards, {val_count} val in {num_val} ({len(images)} {kind} photos); "
            f"{SIZE} px crops, the demo network on them pooled by {args.shrink}; batch {args.batch}, "
            f"{args.workers} loader workers, split mode, {args.epochs} epochs, validation each; {cores} cores; "
            f"median of {args.repeats} repeats\n"
        )
        records: dict[str, list[list[Record]]] = {v: [] for v in VARIANTS}
        walls: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for repeat in range(args.repeats):
            for variant in VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]:
                got, wall = run(variant, cfg)
                records[variant].append(got)
                walls[variant].append(wall)
                print(f"  repeat {repeat + 1}, {variant}: {wall:.1f} s", file=sys.stderr)

    def of(variant: str, kind: str, epochs: Iterable[int]) -> list[Record]:
        wanted = set(epochs)
        return [r for rs in records[variant] for r in rs if r.kind == kind and r.epoch in wanted]

    def row(rs: list[Record], batch: int) -> dict[str, float]:
        return {
            "first": median(r.first_s for r in rs),
            "step": median(r.step_s for r in rs),
            "first/step": median(r.first_s / r.step_s for r in rs),
            "rate": median(r.rate for r in rs),
            "of steady": median(r.rate / (batch / r.step_s) for r in rs),
            "head": median(r.asked - r.handed for r in rs),
        }

    print(
        "| loaders | epoch | first batch, ms | steady step, ms | first / step | epoch images/s "
        "| epoch / steady rate | handed ahead, ms | validation pass, s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for variant in VARIANTS:
        for epoch in range(1, args.epochs + 1):
            r = row(of(variant, "train", [epoch]), args.batch)
            val = median(v.seconds for v in of(variant, "val", [epoch]))
            print(
                f"| {variant} | {epoch} | {1e3 * r['first']:.0f} | {1e3 * r['step']:.0f} | {r['first/step']:.2f}x "
                f"| {r['rate']:.0f} | {r['of steady']:.2f} | {1e3 * r['head']:.0f} | {val:.2f} |"
            )
    later = range(2, args.epochs + 1)
    rows = {v: row(of(v, "train", later), args.batch) for v in VARIANTS}
    vals = {v: median(r.seconds for r in of(v, "val", range(1, args.epochs + 1))) for v in VARIANTS}
    whole = {v: median(walls[v]) for v in VARIANTS}
    pool, fresh = rows["pool"], rows["fresh"]
    print(f"\nEpochs 2-{args.epochs}, every repeat pooled (medians):\n")
    print("| | pool | fresh | pool / fresh | goal |")
    print("|---|---|---|---|---|")
    summary("first batch, ms", 1e3 * pool["first"], 1e3 * fresh["first"], ".0f")
    summary("steady step, ms", 1e3 * pool["step"], 1e3 * fresh["step"], ".0f")
    summary(
        "first batch / steady step",
        pool["first/step"],
        fresh["first/step"],
        ".2f",
        "pool within 2x",
        ratio=False,
        unit="x",
    )
    summary("epoch images/s", pool["rate"], fresh["rate"], ".0f")
    summary("epoch images/s / steady-state rate", pool["of steady"], fresh["of steady"], ".2f", "pool at least 0.95")
    summary("validation pass, s (every epoch)", vals["pool"], vals["fresh"], ".2f")
    summary("whole run, s", whole["pool"], whole["fresh"], ".1f")


def summary(
    name: str, pool: float, fresh: float, fmt: str, goal: str = "", *, ratio: bool = True, unit: str = ""
) -> None:
    """A row of the summary table: pool, fresh, their ratio (where one means something) and the goal."""
    between = f"{pool / fresh:.2f}x" if ratio else ""
    print(f"| {name} | {pool:{fmt}}{unit} | {fresh:{fmt}}{unit} | {between} | {goal} |")


if __name__ == "__main__":
    main()
