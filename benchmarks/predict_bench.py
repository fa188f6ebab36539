"""`raywds predict --ray`'s two ways on the same shards, the same model and the same CPUs, in one run:
images/s of a whole predict (its start, the model's loading and every part written included, as a
user waits for it), median of --repeats runs, each into a fresh --out.

    .venv/bin/python benchmarks/predict_bench.py [--images DIR] [--copies 10] [--model demo] [--repeats 2]

Rows:
  here        no Ray: one process, --loader-workers CPUs - 1 (the baseline)
  loader      --data-plane loader: ranks as Ray tasks, each with its own loader workers
              (CPUs / 2 ranks of one loader worker each)
  ray         --data-plane ray: Ray Data read tasks decode each shard, a pool of model replicas
              scores the blocks (CPUs / 2 replicas; the other CPUs read and decode)
Ratio: ray / loader (the faster becomes `raywds predict --ray`'s default --data-plane).

The shards: the photos in DIR (by default ../shared/data/imagenet-sample-100, real ImageNet JPEGs)
copied --copies times, converted by raywds into shards of 100 samples; the model: --model with
fresh weights, saved as a raywds checkpoint, 224 px centre crops of images resized to 256. A
private local Ray (its own temp dir and token) is started and stopped.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

sys.path.insert(0, str(Path(__file__).parent))
from loader_bench import build_tree, photos

from raywds.config import TrainConfig
from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import read_manifest
from raywds.infer.predictoptions import Prediction
from raywds.launch.prediction import predict_here
from raywds.launch.ray_prediction import predict_on_ray
from raywds.models.sources import parse_model
from raywds.runs.checkpoint import save_checkpoint

BATCH = 64


def checkpoint(shards: Path, model: str, out: Path) -> Path:
    """A raywds checkpoint of `model` with fresh weights for the shards' classes, validated at 224 px."""
    classes = read_manifest(str(shards)).classes
    cfg = TrainConfig(data=str(shards), model=model, image_size=224)
    parsed = parse_model(model)
    state = {"model": parsed.source.build(parsed, len(classes)).state_dict(), "classes": classes}
    save_checkpoint({**state, "config": cfg.to_dict()}, out)
    return out


def timed(fn: Any, out: Path) -> float:
    """Images per second of one predict into a fresh `out`."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    tally = fn(out)
    return tally.samples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    )
    parser.add_argument("--copies", type=int, default=10, help="copies of each photo (default %(default)s)")
    parser.add_argument("--model", default="demo", help="the model to predict with (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if "RAYWDS_BENCH_TOKEN" not in os.environ:
        # A token of our own for the private Ray, in the environment before Ray starts (it reads it once).
        fd, token = tempfile.mkstemp(prefix="rwpr-token-")
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
        env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token, "RAYWDS_BENCH_TOKEN": token}
        try:
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
        finally:
            os.unlink(token)
    with tempfile.TemporaryDirectory(prefix="rwpr-", dir="/tmp") as tmp:
        work = Path(tmp)
        count = build_tree(photos(args.images, work / "generated"), args.copies, work / "tree")
        shards = work / "shards"
        convert(work / "tree", shards, ConvertOptions(maxcount=100, seed=0))
        model = checkpoint(shards, args.model, work / "model.pt")
        cpus = len(os.sched_getaffinity(0))
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, _temp_dir=str(work / "ray"))
        try:
            half = max(1, cpus // 2)
            reading = {"batch_size": BATCH, "loader_workers": 1}

            def job(out: Path) -> Prediction:
                return Prediction(model=str(model), data=str(shards), out=str(out))

            ways = {
                "here": lambda out: predict_here(job(out), {**reading, "loader_workers": max(1, cpus - 1)})[0],  # type: ignore[index]
                "loader": lambda out: predict_on_ray(job(out), reading, "loader", None, half)[0],
                "ray": lambda out: predict_on_ray(job(out), reading, "ray", None, half)[0],
            }
            print(f"{count} samples in {len(list(shards.glob('*.tar')))} shards; {cpus} CPUs; --model {args.model}")
            rows = {
                name: statistics.median(timed(fn, work / f"out-{name}") for _ in range(args.repeats))
                for name, fn in ways.items()
            }
            for name, value in rows.items():
                print(f"  {name:8s} {value:7.1f} images/s")
            print(f"ray / loader {rows['ray'] / rows['loader']:.2f}x")
        finally:
            ray.shutdown()
            Path(os.environ["RAYWDS_BENCH_TOKEN"]).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
