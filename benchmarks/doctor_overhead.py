"""What the step-time attribution behind `raywds doctor` costs (it is always on).

    ./run-venv && .venv/bin/python benchmarks/doctor_overhead.py [--images DIR] [--copies 10] [--rounds 5]

1. The loader: `copies` x the photos in DIR (by default ../shared/data/imagenet-sample-100)
   in shards of 100, split mode, 1 DataLoader worker, 224 px crops (`--decode cpu`), with and
   without the worker's clock (raywds.loader.clock: a timer around each sample's read and
   decode and each batch's collate), interleaved over `rounds` rounds, each first in turn; medians. The rounds
   vary by more than the clock costs on this shared machine, so the clock's own time a sample
   is also measured alone (200,000 samples through its stages around a decoder that does
   nothing but through the resize's own timer) and set against the loader's time a sample.
2. The training loop: the marks each step takes (raywds.train.timing: four marks, the
   seconds between them, the rank's own CPU time), against one real step of a ResNet-50 at
   224 px, batch 32, on this CPU.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from loader_bench import BATCH, build_tree, photos, timed

from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import read_manifest
from raywds.loader.clock import RESIZING, Clock
from raywds.loader.loader import _loader, train_stages
from raywds.loader.stages import train_decoder
from raywds.plan.modes import epoch_plan
from raywds.train.config import TrainConfig
from raywds.train.model import build_model
from raywds.train.timing import StepTimer
from raywds.world import World


def loader_rate(shards: Path, clocked: bool, num_images: int) -> float:
    cfg = TrainConfig(data=str(shards), model="demo", mode="split", batch_size=BATCH, loader_workers=1)
    manifest = read_manifest(str(shards))
    plan = epoch_plan(manifest, cfg, 1, epoch=0)
    clock = Clock() if clocked else None
    stages, skips, where = train_stages(manifest, cfg.loader(), 0, plan, epoch=0, clock=clock)
    return timed(
        _loader(
            stages,
            train_decoder(cfg.loader(), 0),
            cfg.loader(),
            World(),
            where,
            partial=True,
            skips=skips,
            clock=clock,
        ),
        num_images,
    )


def clock_s(count: int = 200_000) -> float:
    """Seconds the clock adds to one sample: its read timed (a shard of 1,000 samples), its
    decode timed (a decoder that does nothing but through the resize's timer, as the `cpu`
    decoder resizes), and a thousandth of a batch's collate and hand-over."""
    clock = Clock()
    samples: list[dict[str, Any]] = [{"__url__": f"shard-{i // 1000}", "jpg": b"x"} for i in range(count)]
    sizes = {f"shard-{i}": 1 << 20 for i in range(count // 1000 + 1)}
    start = time.perf_counter()
    for sample in clock.reading(samples, sizes):
        clock.decoding(_resized, sample["jpg"], 0)
    for _ in range(count // 1000):
        clock.collating(len, [])
        clock.taken()
    timed_s = time.perf_counter() - start
    start = time.perf_counter()
    for sample in samples:
        _nothing(sample["jpg"], 0)
    return (timed_s - (time.perf_counter() - start)) / count


def _nothing(data: bytes, sample_id: int) -> bytes:
    return data


def _resized(data: bytes, sample_id: int) -> bytes:
    return RESIZING.timed(_nothing, data, sample_id)


def marks_s(steps: int = 20_000) -> float:
    """Seconds the marks of one step take on a CPU."""
    timer = StepTimer("cpu")
    start = time.perf_counter()
    for _ in range(steps):
        marks = [timer.mark(), timer.mark(), timer.mark(), timer.mark()]
        timer.between(marks)
        timer.own(marks[1], marks[3])
    return (time.perf_counter() - start) / steps


def step_s(repeats: int = 3) -> float:
    """Seconds of one training step of a ResNet-50 at 224 px, batch 32, on this CPU (the best of `repeats`)."""
    model = build_model("resnet50", 1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images, labels = torch.randn(32, 3, 224, 224), torch.randint(0, 1000, (32,))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "imagenet-sample-100"
    )
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        num_images = build_tree(photos(args.images, root / "photos"), args.copies, root / "tree")
        convert(root / "tree", root / "shards", ConvertOptions(maxcount=100, seed=0))
        rates: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for clocked in (False, True) if round_ % 2 == 0 else (True, False):  # neither always first
                rates[clocked].append(loader_rate(root / "shards", clocked, num_images))
    plain, with_clock = statistics.median(rates[False]), statistics.median(rates[True])
    print(
        f"loader, {num_images} photos, 1 worker, 224 px: {plain:.1f} images/s without the clock, {with_clock:.1f} with"
    )
    print(f"  ratio {with_clock / plain:.3f} (cost {100 * (1 - with_clock / plain):.1f}%); rounds: {rates}")
    per_sample = clock_s()
    print(
        f"  the clock adds {1e6 * per_sample:.2f} us a sample: {100 * per_sample * plain:.2f}% of a worker's "
        f"{1e3 / plain:.2f} ms a sample here"
    )
    per_step, step = marks_s(), step_s()
    print(
        f"loop: the marks take {1e6 * per_step:.1f} us a step; a ResNet-50 step (224 px, batch 32) "
        f"takes {step:.2f} s here: {100 * per_step / step:.5f}%"
    )


if __name__ == "__main__":
    main()
