"""This machine's speed now, in 10 s: one core's full-JPEG-decode rate on the 100 real photos.

    .venv/bin/python benchmarks/decode_speed.py [--images DIR] [--seconds 10]

torchvision.io.decode_jpeg on one thread, over and over, in five spans of a fifth of the time;
prints each span's images/s and their median. It is the limit `loader_bench.py` sets the loader
against, and the yardstick docs/testing.md gives each clean-clone `.ci/run` beside its time: the
machines of one kind differ, and one machine's speed moves from hour to hour, by a quarter and
more, so a suite's minutes mean little without the speed they were taken at. Run it just before
and after the suite, with nothing else running.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torchvision.io import decode_jpeg

PHOTOS = Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--images", type=Path, default=PHOTOS, help="a folder of JPEGs (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    files = sorted(p for p in args.images.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if not files:
        raise SystemExit(f"no JPEGs under {args.images}")
    torch.set_num_threads(1)
    datas = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in files]
    rates = []
    for _ in range(5):
        started, count = time.perf_counter(), 0
        while time.perf_counter() - started < args.seconds / 5:
            for data in datas:
                decode_jpeg(data)
            count += len(datas)
        rates.append(count / (time.perf_counter() - started))
    spans = ", ".join(f"{r:.0f}" for r in rates)
    print(f"full JPEG decode, one core: {statistics.median(rates):.0f} images/s (median of {spans})")


if __name__ == "__main__":
    main()
