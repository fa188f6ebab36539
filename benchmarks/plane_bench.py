"""The Ray Data plane (`raywds ray --data-plane ray`) against two baselines, on the same shards, the
same CPUs and in the same run: images/s delivered to one consuming process (a trainer's side),
224 px training crops, batch 64, over a whole pass (its start included, as an epoch sees it),
median of --repeats passes.

    .venv/bin/python benchmarks/plane_bench.py [--images DIR] [--copies 20] [--repeats 2]
    .venv/bin/python benchmarks/plane_bench.py --address HEAD:6379   # also: all nodes vs one
    .venv/bin/python benchmarks/plane_bench.py --two-nodes           # the same on the tests' two-node cluster

Rows:
  stock       ray.data.read_webdataset (its default decoder: PIL, whole images) + map_batches
              with torchvision's RandomResizedCrop and RandomHorizontalFlip, as uint8
  plane       raywds's Ray Data plane: a read task per shard, blocks of 64 samples, the loader's
              region decoder in the same task (raywds.launch.raydata)
  loader      raywds's per-rank loader: DataLoader workers, one per CPU of the cluster
Ratios: plane / stock (goal >= 2x), plane / loader (goal >= 0.8x).

With --address (a running cluster, e.g. two real machines): the plane with its tasks pinned to
the driver's node, then free to use every node; the ratio is what the other nodes add (goal
>= 1.7x for two equal nodes). Without --address a private local Ray is started (its own temp
dir and token) and stopped. --two-nodes (root, iproute2) starts the tests' two-node cluster
(two network namespaces on this machine, tests/support/netnodes.py, one logical CPU each) and runs the
--address comparison there from the head node: on one machine that shows the second node's
tasks being used, not two machines' speed.

The shards: the photos in DIR (by default ../shared/data/imagenet-sample-100, real ImageNet
JPEGs) copied --copies times, converted by raywds into shards of 100 samples.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.data
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).parent))
from loader_bench import build_tree, photos

from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import read_manifest
from raywds.launch import raydata
from raywds.loader.loader import train_loader
from raywds.loader.stages import train_decoder
from raywds.plan.modes import epoch_plan
from raywds.train.config import TrainConfig
from raywds.world import World

BATCH, SIZE = 64, 224


def rate(batches: Iterable[Any], count: Any) -> float:
    """Images per second over the whole pass, its start included (what an epoch sees)."""
    start, seen = time.perf_counter(), 0
    for batch in batches:
        seen += count(batch)
    return seen / (time.perf_counter() - start)


def config(shards: Path, workers: int) -> TrainConfig:
    return TrainConfig(
        data=str(shards),
        model="demo",
        mode="split",
        batch_size=BATCH,
        image_size=SIZE,
        loader_workers=workers,
        worker_shuffle_buffer=0,
    )


def stock_rate(shards: Path) -> float:
    crop = v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()])

    def rgb(image: np.ndarray) -> torch.Tensor:  # the default decoder keeps grayscale photos 2-D
        image = np.repeat(image[..., None], 3, axis=2) if image.ndim == 2 else image[..., :3]
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)  # a copy: Arrow's buffers are read-only

    def crops(batch: dict[str, Any]) -> dict[str, Any]:
        images = [crop(rgb(im)) for im in batch["jpg"]]
        return {"image": torch.stack(images).permute(0, 2, 3, 1).numpy(), "cls": batch["cls"]}

    urls = sorted(str(p) for p in shards.glob("*-train-*.tar"))
    ds = ray.data.read_webdataset(urls).map_batches(crops, batch_format="numpy", batch_size=BATCH)
    return rate(ds.iter_batches(batch_size=BATCH, batch_format="numpy"), lambda b: len(b["cls"]))


def plane_rate(shards: Path, only_node: str | None = None) -> float:
    cfg = config(shards, 0)
    manifest = read_manifest(str(shards))
    plan = epoch_plan(manifest, cfg, 1, epoch=0)
    plane = raydata.RayData(raydata.Plane())
    if only_node is None:
        return rate(plane.train(manifest, cfg.loader(), World(), plan, epoch=0), lambda b: len(b.keys))
    pinned = NodeAffinitySchedulingStrategy(only_node, soft=False)
    loader_cfg = cfg.loader()
    decoder = train_decoder(loader_cfg, 0)
    source = raydata.ShardSource(manifest, "train", plan.slot(0, 0), loader_cfg, exact=True, decoder=decoder)
    ds = ray.data.read_datasource(source, override_num_blocks=len(source.groups), scheduling_strategy=pinned)
    return rate(ds.iter_batches(batch_size=BATCH, batch_format="numpy"), lambda b: len(b["id"]))


def loader_rate(shards: Path, workers: int) -> float:
    cfg = config(shards, workers)
    manifest = read_manifest(str(shards))
    plan = epoch_plan(manifest, cfg, 1, epoch=0)
    return rate(train_loader(manifest, cfg.loader(), World(), plan, epoch=0), lambda b: len(b.keys))


def median(runs: int, fn: Any, *args: Any) -> float:
    return statistics.median(fn(*args) for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    )
    parser.add_argument("--copies", type=int, default=20, help="copies of each photo (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--address", help="a running cluster: also compare all its nodes with the driver's alone")
    parser.add_argument("--two-nodes", action="store_true", help="run --address on the tests' two-node cluster")
    args = parser.parse_args()
    if args.two_nodes:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from support import netnodes  # the tests' two-node cluster

        with netnodes.two_nodes("rwpb2-", head_cpus=1, worker_cpus=1) as cluster:
            flags = ["--images", str(args.images), "--copies", str(args.copies), "--repeats", str(args.repeats)]
            out = cluster.run([sys.executable, __file__, "--address", cluster.gcs_address, *flags], timeout=1800)
        print(out.stdout[-3000:] if out.returncode == 0 else out.stdout[-3000:] + out.stderr[-3000:])
        raise SystemExit(out.returncode)
    if not args.address and "RAYWDS_BENCH_TOKEN" not in os.environ:
        # A token of our own for the private Ray, in the environment before Ray is imported (it reads it once).
        fd, token = tempfile.mkstemp(prefix="rwpb-token-")
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
        env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token, "RAYWDS_BENCH_TOKEN": token}
        try:
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
        finally:
            os.unlink(token)
    with tempfile.TemporaryDirectory(prefix="rwpb-", dir="/tmp") as tmp:
        work = Path(tmp)
        count = build_tree(photos(args.images, work / "generated"), args.copies, work / "tree")
        shards = work / "shards"
        convert(work / "tree", shards, ConvertOptions(maxcount=100, seed=0))
        if args.address:
            ray.init(address=args.address)
        else:
            ray.init(address="local", include_dashboard=False, _temp_dir=str(work / "ray"))
        try:
            cpus = int(ray.cluster_resources()["CPU"])
            nodes = [n for n in ray.nodes() if n["Alive"]]
            num_shards = len(list(shards.glob("*-train-*.tar")))
            print(f"{count} samples in {num_shards} shards; {len(nodes)} node(s), {cpus} CPUs")
            rows = {
                "stock": median(args.repeats, stock_rate, shards),
                "plane": median(args.repeats, plane_rate, shards),
                "loader": median(args.repeats, loader_rate, shards, cpus),
            }
            for name, value in rows.items():
                print(f"  {name:8s} {value:7.1f} images/s")
            print(f"plane / stock  {rows['plane'] / rows['stock']:.2f}x (goal >= 2x)")
            print(f"plane / loader {rows['plane'] / rows['loader']:.2f}x (goal >= 0.8x, the cost of the plane)")
            if args.address:
                here = ray.get_runtime_context().get_node_id()
                alone = median(args.repeats, plane_rate, shards, here)
                everywhere = rows["plane"]
                print(f"  driver's node alone {alone:7.1f} images/s; all {len(nodes)} nodes {everywhere:7.1f}")
                print(f"all nodes / one node {everywhere / alone:.2f}x")
        finally:
            ray.shutdown()
            if "RAYWDS_BENCH_TOKEN" in os.environ:
                Path(os.environ["RAYWDS_BENCH_TOKEN"]).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
