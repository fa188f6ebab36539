"""`raywds ray --data-plane ray` against `--data-plane loader`, as a user runs them: the same
shards of real photos, 224 px crops, batch 64, a model small enough that the data is what
bounds the steps (the `demo` network after an 8x average pool, --shrink, planted in every
process of the run by benchmarks/shrunk/sitecustomize.py: the loader still makes and hands
over the 224 px crops), one rank, the same CPUs, in one run of this script. Each run trains
--epochs epochs (split mode; the photos are a training split only) on a private local Ray of its own (its own temp
dir and token), and the figure is the median of epochs 2..N's images/s, from the run's own
metrics.jsonl (what the epoch lines say), so the first epoch's start is left out and every
later epoch's is in.

    .venv/bin/python benchmarks/plane_train_bench.py [--images DIR] [--copies 20] [--epochs 4] [--repeats 2]

The runs alternate (loader, ray, feeder, loader, ...) and the medians over --repeats runs are
reported, with the ratio plane / loader (goal: at least 0.9x, stretch 1.0x). `ray` runs each
rank's Ray Data executor in the rank's own process, `feeder` in a feeder actor of the rank's
(--plane-executor). The loader runs
with one DataLoader worker per CPU Ray sees (2 on a 2-core machine); the plane's decode tasks
may use every CPU Ray leaves free of the rank's own.

The shards: the photos in DIR (by default ../shared/data/imagenet-sample-100, real ImageNet
JPEGs) copied --copies times, converted by raywds into shards of 100 samples.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from loader_bench import build_tree, photos

from raywds.data.convert import ConvertOptions, convert

ROOT = Path(__file__).resolve().parents[1]


PLANES = {
    "loader": ["--data-plane", "loader"],
    "ray": ["--data-plane", "ray"],
    "feeder": ["--data-plane", "ray", "--plane-executor", "feeder"],
}
"""Each row's flags: the per-rank loader, the plane with each rank's executor in the rank, and in
a feeder actor of the rank's."""


def run(shards: Path, plane: str, epochs: int, work: Path, cpus: int, shrink: int) -> list[float]:
    """One `raywds ray` run; each epoch's images/s from its metrics.jsonl."""
    temp = Path(tempfile.mkdtemp(prefix="r", dir=work))
    token = temp / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_TMPDIR=str(temp), RAY_ADDRESS="local",
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAYWDS_BENCH_SHRINK=str(shrink),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent / "shrunk"), os.environ.get("PYTHONPATH", "")]),
    )  # fmt: skip
    line = [
        str(ROOT / ".venv/bin/raywds"), "ray", "--data", str(shards), "--model", "demo", "--mode", "split",
        "--image-size", "224", "--batch-size", "64", "--epochs", str(epochs), "--num-workers", "1",
        "--loader-workers", str(cpus), *PLANES[plane], "--storage-path", str(temp / "runs"),
        "--name", plane, "--worker-shuffle-buffer", "0",
    ]  # fmt: skip
    out = subprocess.run(line, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"raywds ray --data-plane {plane} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for p in (temp / "runs").rglob("metrics.jsonl") for line in p.read_text().splitlines()]
    return [r["images_per_s"] for r in rows if r.get("kind") == "epoch"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, default=ROOT.parent / "shared/data/imagenet-sample-100")
    parser.add_argument("--copies", type=int, default=20, help="copies of each photo (default %(default)s)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--planes", nargs="+", choices=list(PLANES), default=list(PLANES))
    parser.add_argument("--shrink", type=int, default=8, help="average-pool the crops by this before the network")
    args = parser.parse_args()
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="rwpt-", dir="/tmp") as tmp:
        work = Path(tmp)
        count = build_tree(photos(args.images, work / "generated"), args.copies, work / "tree")
        shards = work / "shards"
        convert(work / "tree", shards, ConvertOptions(maxcount=100, seed=0))
        print(f"{count} photos, {len(list(shards.glob('*-train-*.tar')))} train shards; {cpus} CPUs")
        epochs: dict[str, list[list[float]]] = {plane: [] for plane in args.planes}
        for _ in range(args.repeats):
            for plane in epochs:
                epochs[plane].append(run(shards, plane, args.epochs, work, cpus, args.shrink))
                print(f"  {plane:6s} epochs' images/s: {', '.join(f'{r:.1f}' for r in epochs[plane][-1])}")
        later = {plane: statistics.median(r for one in runs for r in one[1:]) for plane, runs in epochs.items()}
        first = {plane: statistics.median(one[0] for one in runs) for plane, runs in epochs.items()}
        print("\n| data plane | epoch 1 images/s | epochs 2-N images/s (median) |\n|---|---|---|")
        for plane in epochs:
            print(f"| {plane} | {first[plane]:.1f} | {later[plane]:.1f} |")
        for plane in ("ray", "feeder"):
            if plane in later and "loader" in later:
                print(f"{plane} / loader, epochs 2-{args.epochs}: {later[plane] / later['loader']:.2f}x (goal >= 0.9x)")


if __name__ == "__main__":
    main()
