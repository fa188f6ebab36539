"""Training throughput on one device: how close raywds's loader keeps a GPU to its synthetic-data ceiling.

    .venv/bin/python benchmarks/gpu_bench.py --images ../shared/data/imagenet-sample-100 [--compile] [--json OUT]
    .venv/bin/python benchmarks/gpu_bench.py --quick     # CPU smoke run: resnet18, 32 px (< 2 min on 2 cores)

Trains the `imagenet-resnet50` recipe's model (ResNet-50, batch 256, 224 px; a 1000-class head,
as on ImageNet) through raywds's own step (raywds.train.loop.train_epoch with
raywds.train.compute.Compute: bf16 autocast, channels_last, normalisation on the device), one
model and optimizer for every row, and times `--steps` steps after a warm-up, one row each:

(a) synthetic: uint8 images and labels already on the device, no loader (the ceiling);
(b) the shards on local disk, `--decode cpu`, for each of `--workers` loader workers;
(c) the same, `--decode device` (workers send JPEG bytes; the device decodes: nvJPEG on a GPU);
(d) the shards over HTTP from raywds's embedded server (in a process of its own), with the
    decoder and worker count of the fastest row of (b) and (c).

Each row gives images/s, the mean and median step time, the data-wait fraction (the share of
the timed steps spent waiting for the loader's next batch) and images/s against (a). Decoding
on the device happens inside the step, so `device` rows show it as step time, not data wait.
The data is built here: the JPEGs in `--images` (the 100 real ImageNet photos) repeated into
`--num-samples` samples, written to `--num-shards` shards by raywds's converter (or reused
from `--shards` when it holds them already).

Without a GPU (or with `--device cpu`) the model is resnet18 at 32 px, batch 16, and the
output says so: such numbers only show that the path runs. `--quick` also shrinks the data and
the step counts to a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

import torch
import torch._dynamo
import torchvision

from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import MANIFEST, read_manifest
from raywds.loader import crops
from raywds.loader.loader import train_loader
from raywds.loader.settings import DecodeName
from raywds.loader.stages import Batch
from raywds.plan.modes import epoch_plan
from raywds.serve import ShardServer
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig, resolve
from raywds.train.loop import EpochResult, train_epoch
from raywds.train.model import build_model
from raywds.train.optim import make_optimizer
from raywds.world import World

RECIPE = "imagenet-resnet50"
NUM_CLASSES = 1000
"""The model's head, as on ImageNet (the sample's 100 classes use the first 100)."""
SMALL: dict[str, Any] = dict(model="resnet18", image_size=32, batch_size=16)
"""What a CPU runs instead of the recipe's ResNet-50 at 224 px."""
QUICK = dict(num_samples=1600, num_shards=16, workers="1,2", steps=5)
"""--quick's defaults (and 3 warm-up steps before each row, plus 2 per loader worker)."""


@dataclasses.dataclass
class Row:
    """One row of the table: a way of feeding the same training steps, and how fast they ran."""

    name: str
    decode: str
    num_workers: int
    num_steps: int
    images_per_s: float
    step_ms_mean: float
    step_ms_median: float
    data_wait: float
    """Share of the timed steps' wall time spent waiting for the loader."""
    vs_synthetic: float = 1.0
    error: str = ""
    """Why the row could not be measured (its numbers are then NaN)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    parser.add_argument("--images", type=Path, default=here, help="folder of JPEGs to build the shards from")
    parser.add_argument("--shards", type=Path, help="where to build the shards, or reuse them (default: a temp dir)")
    parser.add_argument("--num-samples", type=int, default=20_000, help="samples in the shards (repeated photos)")
    parser.add_argument("--num-shards", type=int, default=16)
    parser.add_argument("--workers", default="4,8,15", help="loader worker counts for rows (b) and (c)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per row")
    parser.add_argument(
        "--warmup-steps", type=int, help="untimed steps before each row (default 10, and 2 more per loader worker)"
    )
    parser.add_argument("--device", help="default: cuda:0 when torch sees a GPU, else cpu")
    parser.add_argument("--model", help="default: the recipe's resnet50 (resnet18 on a CPU)")
    parser.add_argument("--batch-size", type=int, help="default: the recipe's 256 (16 on a CPU)")
    parser.add_argument("--image-size", type=int, help="default: the recipe's 224 (32 on a CPU)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--memory-format", choices=["channels_last", "contiguous"], default="channels_last")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (once, for every row)")
    parser.add_argument("--skip-http", action="store_true", help="leave out row (d)")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: few samples, steps and workers")
    parser.add_argument("--json", type=Path, help="also write the header and rows here")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    args.device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    args.worker_counts = [int(w) for w in str(args.workers).split(",") if w.strip()]
    if not args.worker_counts or min(args.worker_counts) < 1:
        parser.error(f"--workers {args.workers!r}: give counts of at least 1, comma-separated, e.g. 4,8,15")
    if args.steps < 1 or (args.warmup_steps is not None and args.warmup_steps < 1):
        parser.error("--steps and --warmup-steps must be at least 1 (the clock starts after a warm-up step)")
    if args.num_samples < args.num_shards:
        parser.error(f"--num-samples {args.num_samples} is fewer than --num-shards {args.num_shards}")
    return args


def config(args: argparse.Namespace, data: str) -> TrainConfig:
    """The recipe, with what this machine runs instead (a small model on a CPU) and the flags."""
    small = SMALL if not args.device.startswith("cuda") else {}
    flags = {
        "model": args.model or small.get("model"),
        "batch_size": args.batch_size or small.get("batch_size"),
        "image_size": args.image_size or small.get("image_size"),
    }
    return resolve(
        data,
        recipe=RECIPE,
        precision=args.precision,
        memory_format=args.memory_format,
        compile=args.compile,
        mode="resample",
        **flags,
    )


# --- data ----------------------------------------------------------------------------------------


def photos(folder: Path) -> list[Path]:
    found = sorted(p for p in folder.glob("*") if p.suffix.lower() in (".jpeg", ".jpg")) if folder.is_dir() else []
    if not found:
        sys.exit(f"gpu_bench: no JPEGs in {folder}; give the 100-photo sample with --images DIR")
    return found


def build_shards(images: list[Path], out: Path, num_samples: int, num_shards: int) -> dict[str, Any]:
    """`images` repeated into `num_samples` files of an ImageNet tree (hard links where the
    filesystem allows), converted by raywds into `num_shards` shards at `out`."""
    if (out / MANIFEST).is_file():
        manifest = json.loads((out / MANIFEST).read_text())
        train = manifest["splits"]["train"]
        if train["num_samples"] == num_samples and len(train["shards"]) >= num_shards:
            return manifest
        sys.exit(f"gpu_bench: {out} holds other shards ({train['num_samples']} samples); give an empty --shards")
    tree = out.parent / f".{out.name}-tree"
    shutil.rmtree(tree, ignore_errors=True)
    copies = math.ceil(num_samples / len(images))
    made = 0
    for copy in range(copies):
        for path in images:
            if made == num_samples:
                break
            folder = tree / "train" / path.name.split("_")[0]
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / f"{path.stem}_{copy}{path.suffix}"
            try:
                os.link(path, target)
            except OSError:
                shutil.copy(path, target)
            made += 1
    try:
        options = ConvertOptions(maxcount=math.ceil(num_samples / num_shards), workers=len(cores()))
        return convert(tree, out, options)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def cores() -> set[int]:
    return os.sched_getaffinity(0)


def _serve(root: str, conn: Connection) -> None:
    with ShardServer(root, backend="embedded") as server:
        conn.send(server.url)
        conn.recv()  # until told to stop, or the parent is gone


@contextlib.contextmanager
def served(root: Path) -> Iterator[str]:
    """The shards at `root` from raywds's embedded server, in a process of its own (its threads
    would otherwise share the training process's GIL); yields the URL."""
    parent, child = multiprocessing.get_context("fork").Pipe()
    process = multiprocessing.get_context("fork").Process(target=_serve, args=(str(root), child), daemon=True)
    process.start()
    try:
        if not parent.poll(60):
            raise RuntimeError(f"the embedded shard server for {root} did not start within 60 s")
        yield str(parent.recv())
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        process.join(timeout=15)
        if process.is_alive():
            process.terminate()


# --- timing --------------------------------------------------------------------------------------


class Trainee:
    """One model, optimizer and Compute for every row: cuDNN's choices and a compiled graph carry over."""

    def __init__(self, cfg: TrainConfig, world: World):
        self.cfg, self.world = cfg, world
        self.compute = Compute.for_run(cfg, world.device)
        self.model = self.compute.model(build_model(cfg.model, NUM_CLASSES))
        self.optimizer = make_optimizer(self.model, cfg, world)
        self.run: torch.nn.Module = torch.compile(self.model) if cfg.compile else self.model  # type: ignore[assignment]
        self.lr = cfg.peak_lr(world.world_size) / 10  # throughput does not depend on the rate

    def measure(
        self, name: str, batches: Iterable[Batch], *, warmup: int, steps: int, how: str = "-", workers: int = 0
    ) -> Row:
        """Train on `batches` for `warmup` + `steps` steps through the real loop, timing the last `steps`."""
        at: list[tuple[float, float, int]] = []  # after each step: seconds, data wait, samples

        def after_step(step: int, batch: Batch, so_far: EpochResult) -> bool:
            at.append((so_far.seconds, so_far.data_wait_s, so_far.num_samples))
            return step >= warmup + steps

        result = train_epoch(
            self.run,
            batches,
            self.optimizer,
            lambda step: self.lr,
            self.world,
            self.compute,
            uneven=False,
            label_smoothing=self.cfg.label_smoothing,
            after_step=after_step,
        )
        if result.num_steps < warmup + steps:
            raise RuntimeError(f"{name}: the batches ran out after {result.num_steps} of {warmup + steps} steps")
        (t0, w0, n0), (t1, w1, n1) = at[warmup - 1], at[-1]
        durations = [b[0] - a[0] for a, b in zip(at[warmup - 1 : -1], at[warmup:])]
        return Row(
            name=name,
            decode=how,
            num_workers=workers,
            num_steps=steps,
            images_per_s=(n1 - n0) / (t1 - t0),
            step_ms_mean=1000 * (t1 - t0) / steps,
            step_ms_median=1000 * statistics.median(durations),
            data_wait=(w1 - w0) / (t1 - t0),
        )


def synthetic(cfg: TrainConfig, device: str) -> Iterator[Batch]:
    """The same uint8 batch, already on the device, for ever."""
    size, n = cfg.image_size, cfg.batch_size
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, device=device)
    labels = torch.randint(0, NUM_CLASSES, (n,), device=device)
    ids = torch.arange(n)
    while True:
        yield Batch(images, labels, ids, [])


def loader_row(
    trainee: Trainee, name: str, data: str, how: DecodeName, workers: int, *, warmup: int, steps: int
) -> Row:
    cfg = dataclasses.replace(
        trainee.cfg, data=data, decode=how, loader_workers=workers, batches_per_epoch=warmup + steps
    )
    manifest = read_manifest(data)
    batches = train_loader(manifest, cfg.loader(), trainee.world, epoch_plan(manifest, cfg, 1, epoch=0), epoch=0)
    return trainee.measure(name, batches, warmup=warmup, steps=steps, how=how, workers=workers)


# --- report --------------------------------------------------------------------------------------


def linked_libjpeg(library: str) -> str:
    """The libjpeg file the dynamic linker gives `library` (by ldd: the carried one on the GPU machine)."""
    try:
        out = subprocess.run(["ldd", library], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"libjpeg (ldd failed: {e})"
    for entry in out.splitlines():
        if "libjpeg" in entry and "=>" in entry:
            return entry.split("=>")[1].split("(")[0].strip()
    return "libjpeg (not found by ldd)"


def header(
    args: argparse.Namespace, cfg: TrainConfig, compute: Compute, manifest: dict[str, Any], num_photos: int
) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    if crops._jpeg is not None:
        library = str(crops._jpeg.__file__)
        jpeg = f"raywds.loader._jpeg (region decoding), {library}, linked to {linked_libjpeg(library)}"
    else:
        jpeg = "fallback: whole-image decoding (raywds.loader._jpeg was not built)"
    train = manifest["splits"]["train"]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(args.device) if cuda else f"CPU ({platform.processor() or 'unknown'})",
        "cores": len(cores()),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "model": cfg.model,
        "num_classes": NUM_CLASSES,
        "image_size": cfg.image_size,
        "batch_size": cfg.batch_size,
        "precision": "bf16 autocast" if compute.autocast_dtype is not None else "fp32",
        "memory_format": "channels_last" if compute.channels_last else "contiguous",
        "compile": cfg.compile,
        "cpu_decoder": jpeg,
        "device_decoder": f"torchvision.io.decode_jpeg on {args.device}" + (" (nvJPEG)" if cuda else ""),
        "data": f"{train['num_samples']} samples in {len(train['shards'])} shards, {num_photos} JPEGs from "
        f"{args.images} repeated",
        "steps": args.steps,
        "on_cpu": not cuda,
    }


def print_header(info: dict[str, Any]) -> None:
    if info["on_cpu"]:
        print(
            f"RAN ON THE CPU WITH A SMALL MODEL ({info['model']}, {info['image_size']} px, batch "
            f"{info['batch_size']}): these are not GPU numbers; they show only that every row runs."
        )
    for key, value in info.items():
        if key != "on_cpu":
            print(f"{key:15s} {value}")
    sys.stdout.flush()


COLUMNS = f"{'row':30s} {'decode':6s} {'workers':>7s} {'images/s':>9s} {'step ms':>8s} {'median':>7s} {'data wait':>9s}"


def line(r: Row, ratio: bool = True) -> str:
    workers = str(r.num_workers) if r.num_workers else "-"
    if r.error:
        return f"{r.name:30s} {r.decode:6s} {workers:>7s} FAILED: {r.error}"
    text = (
        f"{r.name:30s} {r.decode:6s} {workers:>7s} {r.images_per_s:9.1f} {r.step_ms_mean:8.1f} "
        f"{r.step_ms_median:7.1f} {r.data_wait:9.1%}"
    )
    return text + (f" {r.vs_synthetic:6.2f}x" if ratio else "")


def warmup_steps(args: argparse.Namespace, workers: int) -> int:
    """Untimed steps before a row: by default 10, and 2 more per loader worker, so that the batches
    every worker prefetched (2 each) while the row started are used up before the clock starts."""
    if args.warmup_steps is not None:
        return int(args.warmup_steps)
    return (3 if args.quick else 10) + 2 * workers


def run_rows(args: argparse.Namespace, trainee: Trainee, shards: Path, url: str | None) -> list[Row]:
    """Rows (a) to (d), each printed as it is measured."""

    def shown(row: Row) -> Row:
        print(line(row, ratio=False), flush=True)
        return row

    def from_loader(name: str, data: str, how: DecodeName, workers: int) -> Row:
        """The row, or where it fails (a decoder the device cannot run, say) a row saying why: the other rows go on."""
        warmup = warmup_steps(args, workers)
        try:
            return shown(loader_row(trainee, name, data, how, workers, warmup=warmup, steps=args.steps))
        except RuntimeError as e:
            nan = float("nan")
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}" if str(e).strip() else type(e).__name__
            return shown(Row(name, how, workers, 0, nan, nan, nan, nan, error=why))

    batches = synthetic(trainee.cfg, args.device)
    ceiling = trainee.measure("(a) synthetic, on the device", batches, warmup=warmup_steps(args, 0), steps=args.steps)
    rows = [shown(ceiling)]
    for how, name in (("cpu", "(b) local shards"), ("device", "(c) local shards")):
        rows += [from_loader(name, str(shards), cast(DecodeName, how), workers) for workers in args.worker_counts]
    if url is not None:
        best = max((r for r in rows[1:] if not r.error), key=lambda r: r.images_per_s, default=rows[1])
        rows.append(from_loader("(d) HTTP, embedded server", url, cast(DecodeName, best.decode), best.num_workers))
    for row in rows:
        row.vs_synthetic = row.images_per_s / ceiling.images_per_s
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    images = photos(args.images)
    with contextlib.ExitStack() as stack:
        shards = args.shards or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-bench-"))) / "shards"
        started = time.perf_counter()
        manifest = build_shards(images, shards, args.num_samples, args.num_shards)
        print(f"shards ready in {time.perf_counter() - started:.1f} s: {shards}", flush=True)
        # The server's process is forked before CUDA starts or any thread runs in this one.
        url = None if args.skip_http else stack.enter_context(served(shards))
        if not args.device.startswith("cuda"):
            torch.set_num_threads(1)  # the loader workers take the other cores
        trainee = Trainee(config(args, str(shards)), World(device=args.device))
        info = header(args, trainee.cfg, trainee.compute, manifest, len(images))
        print_header(info)
        print(f"\n{COLUMNS}", flush=True)
        rows = run_rows(args, trainee, shards, url)
    if trainee.cfg.compile:  # a ResNet has no graph breaks: 1 means no row made torch.compile trace it again
        info["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print()
    print_header(info)
    print(f"\n{COLUMNS} {'vs (a)':>7s}")
    for row in rows:
        print(line(row))
    if args.json is not None:
        args.json.write_text(json.dumps({**info, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
        print(f"written to {args.json}")
    failed = [f"{r.name} {r.decode} {r.num_workers}" for r in rows if r.error]
    if failed:
        sys.exit(f"gpu_bench: {len(failed)} row(s) failed: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
