"""What flushing a checkpoint to the disk costs: `save_checkpoint` with and without fsync (of the
file before its rename, and of the folder after).

    ./run-venv && .venv/bin/python benchmarks/checkpoint_bench.py [--dir runs/bench] [--model resnet18] [--rounds 5]

The state is a real one: the model's weights and an SGD optimizer with momentum (one buffer per
weight), as `raywds train` saves it each epoch. The two ways are interleaved over `rounds` rounds
in a folder on the disk under test (`--dir`; a tmpfs makes fsync free); medians, and the ratio
within this run (the machine may be shared, so compare ratios, not seconds, across runs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from raywds.runs.checkpoint import save_checkpoint
from raywds.runs.files import CHECKPOINT as CHECKPOINT_FILE
from raywds.train.model import build_model


def state_of(model_name: str) -> dict[str, Any]:
    """A checkpoint's weights and optimizer after one step, so the momentum buffers exist."""
    model = build_model(model_name, 1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 1}


def timed_save(state: dict[str, Any], path: Path, durable: bool) -> float:
    start = time.perf_counter()
    save_checkpoint(state, path, durable=durable)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="a folder on the disk to measure (default: a temp folder in .)")
    parser.add_argument("--model", default="resnet18", help="torchvision model whose state is saved")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    state = state_of(args.model)
    base = Path(args.dir) if args.dir else Path.cwd()
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="checkpoint-bench-", dir=base) as tmp:
        path = Path(tmp) / CHECKPOINT_FILE
        timed_save(state, path, durable=False)  # warm: the first write allocates the file's blocks
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for durable in (False, True):
                times[durable].append(timed_save(state, path, durable))
        size = path.stat().st_size
    plain, synced = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.model}: {size / 1e6:.1f} MB per checkpoint in {base.resolve()}, median of {args.rounds}")
    print(f"  without fsync  {plain:.3f} s")
    print(f"  with fsync     {synced:.3f} s  ({synced / plain:.2f}x, +{synced - plain:.3f} s per checkpoint)")


if __name__ == "__main__":
    main()
