"""raywds's fine-tuning against timm's own `train.py`, on the same shards, from the same weights.

    .venv/bin/python benchmarks/finetune_bench.py --timm-train PATH/train.py [--images DIR]
        [--model test_resnet] [--image-size 224] [--shrink 8] [--classes 10] [--train-variants 10]
        [--val-variants 2] [--epochs 3] [--batch-size 64] [--workers 2] [--lr 0.05] [--rounds 3]

timm's `train.py` is not in the timm wheel: it is the training script of the
huggingface/pytorch-image-models repository. Take it at the tag of the installed timm:

    git clone --depth 1 --branch v$(.venv/bin/python -c "import timm; print(timm.__version__)") \
        https://github.com/huggingface/pytorch-image-models /tmp/pim
    .venv/bin/python benchmarks/finetune_bench.py --timm-train /tmp/pim/train.py

The data: the photos in DIR (by default ../shared/data/imagenet-sample-100, 100 real ImageNet
JPEGs), sorted by name and dealt into --classes classes of consecutive photos (one class holds
neighbouring synsets). Each photo gives --train-variants training and --val-variants validation
images, each its own random crop (60 to 100% of the area), flip and JPEG quality, resized back
to the photo's size: no two are the same bytes, and the validation images are new views of the
photos trained on, so a few epochs can learn them. `raywds convert` writes the tree as shards of
100 samples; its `_info.json` is what lets timm's `wds/` reader use the same files.

The weights: timm's --model with --classes outputs, initialised from torch's seed 0 and written
as one .safetensors file; both tools start from it (`--initial-checkpoint`), so neither replaces
the classifier. There is no network to the Hugging Face Hub here, so the weights are random but
fixed: the top-1 says whether both learn alike, not what pretrained weights would reach.

The network: on a 2-core CPU even timm's test_resnet takes longer a step than the loaders take a
batch, so both tools' processes get a sitecustomize.py (PYTHONPATH) that makes every model
timm.create_model builds average-pool its input by --shrink before its first layer (a forward
pre-hook: no tensors added, the weights load as they are). The loaders still decode, crop and
hand over the full --image-size crops; the step is then about as short as a GPU's.
`--shrink 1` trains the network as it is.

The runs, paired and interleaved (raywds, timm; timm, raywds; ...), each a fresh process on the
CPU: `raywds train --mode split` (every training sample once an epoch) and timm's `train.py
--dataset wds/imagenet --device cpu` (its prefetcher normalises the uint8 batches in the main
process, as raywds does), with the same epochs, batch, loader workers, crop size, SGD (momentum
0.9, nesterov), lr, weight decay (none on norms and biases), cosine schedule by step without
warm-up, no label smoothing, no colour jitter, bilinear resizing, mean, std, crop ratio, and
seed (the round's number). timm's wds reader makes each worker's share of an epoch whole
batches, going round its shards again where they run short, so its epoch repeats samples (with
shards unevenly dealt, or several ranks, it also misses some); raywds's split mode reads every
sample once. Each tool's images/s counts what it trained on.

Figures, each the median over --rounds rounds:
  train images/s   samples trained in epochs 2..N over those epochs' training loops (from the
                   loop's start to its last step: raywds's metrics.jsonl `stages.seconds`;
                   timm's log, its average step time times its steps), so the first epoch's
                   worker start is left out
  run images/s     every sample trained over the whole command's wall time: process start,
                   imports, validation and checkpoints included
  CPU ms a sample  the whole command's CPU time (user and system, every process of it) over the
                   samples trained: what other jobs on a shared machine do not change much
  val top-1        the last epoch's (raywds's val_top1; timm's eval_top1 from its summary.csv)
and the ratio raywds / timm of each, and the ratio of train images/s round by round (goal: at
least 1.5x at equal top-1 within noise). Each run's line also gives its epochs' images/s, the
load average before and after it, where raywds's epochs went (its metrics' `stages`, epochs
2..N: the loop's wait for batches, the batch's copy and normalising, forward, backward; the
workers' decode, resize and read, summed over workers) and timm's wait for batches an epoch.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import random
import re
import resource
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
RAYWDS = ROOT / ".venv/bin/raywds"
PYTHON = ROOT / ".venv/bin/python"
TIMM_STEP = re.compile(
    r"Train: (?P<epoch>\d+) \[\s*(?P<step>\d+)/(?P<steps>\d+).*?"
    r"Time: [\d.]+s,\s+[\d.]+/s\s+\((?P<avg>[\d.]+)s,.*?Data: [\d.]+ \((?P<data>[\d.]+)\)"
)
"""One of timm's training log lines: epoch, step, steps an epoch, the epoch's average step
seconds so far (from the loop's start), its average data wait."""

SHRINK_SITE = '''"""Written by benchmarks/finetune_bench.py: every model timm.create_model builds, in this
interpreter, average-pools its input by FINETUNE_BENCH_SHRINK first (no tensors added)."""
import importlib.abc, importlib.util, os, sys

FACTOR = int(os.environ["FINETUNE_BENCH_SHRINK"])


def _pooled(create):
    def create_model(*args, **kwargs):
        import torch.nn.functional as F

        model = create(*args, **kwargs)
        model.register_forward_pre_hook(lambda _m, inputs: (F.avg_pool2d(inputs[0], FACTOR), *inputs[1:]))
        return model

    return create_model


class _AfterTimm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "timm":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.create_model = module.models.create_model = _pooled(module.models.create_model)

        spec.loader.exec_module = exec_module
        return spec


if FACTOR > 1:
    sys.meta_path.insert(0, _AfterTimm())
'''
"""A sitecustomize.py for both tools' processes (PYTHONPATH): each timm model pools its input
by --shrink before its first layer, so that the network's step on a 2-core CPU is no longer
than the loader's batch, as on a GPU; the loaders still make and hand over the full crops."""


@dataclass
class Run:
    """One tool's run: per epoch the samples trained and the training loop's seconds; the last
    validation's top-1; the whole command's seconds; where the time went."""

    wall: float
    cpu: float
    samples: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    top1: float = 0.0
    notes: dict[str, float] = field(default_factory=dict)

    def train_rate(self) -> float:
        """Images/s of epochs 2..N's training loops (all epochs where there is one)."""
        later = slice(1, None) if len(self.samples) > 1 else slice(None)
        return sum(self.samples[later]) / sum(self.seconds[later])

    def run_rate(self) -> float:
        return sum(self.samples) / self.wall

    def cpu_ms(self) -> float:
        """The whole command's CPU milliseconds per trained sample."""
        return 1000 * self.cpu / sum(self.samples)


def make_tree(images: Path, root: Path, classes: int, train_variants: int, val_variants: int) -> int:
    """ImageFolder train/ and val/ under `root`: each photo's variants in its class; returns the
    number of training images."""
    found = sorted(images.glob("*.JPEG"))
    if not found:
        raise SystemExit(f"no *.JPEG in {images}: give --images a folder of JPEG photos")
    rng = random.Random(0)
    per_class = -(-len(found) // classes)
    for i, path in enumerate(found):
        label = f"class{i // per_class:02d}"
        with Image.open(path) as opened:
            photo = opened.convert("RGB")
        for split, count in (("train", train_variants), ("val", val_variants)):
            folder = root / split / label
            folder.mkdir(parents=True, exist_ok=True)
            for v in range(count):
                variant(photo, rng).save(folder / f"{path.stem}_{split}{v}.JPEG", quality=rng.randint(85, 95))
    return len(found) * train_variants


def variant(photo: Image.Image, rng: random.Random) -> Image.Image:
    """A random crop of 60-100% of the photo's area, maybe flipped, resized back to its size."""
    w, h = photo.size
    area = rng.uniform(0.6, 1.0)
    cw, ch = max(1, round(w * area**0.5)), max(1, round(h * area**0.5))
    x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
    out = photo.crop((x, y, x + cw, y + ch)).resize((w, h), Image.Resampling.BILINEAR)
    return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else out


def write_weights(model: str, classes: int, path: Path) -> None:
    """timm's `model` with `classes` outputs, initialised from torch's seed 0, as .safetensors."""
    import timm
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = timm.create_model(model, pretrained=False, num_classes=classes)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))


def timed(line: list[str], log: Path, env: dict[str, str]) -> tuple[float, float]:
    """Run `line`, its stdout and stderr into `log`; its wall seconds and the CPU seconds (user and
    system) of its processes, loader workers included. A failure ends the benchmark."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(line, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=1800)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        tail = log.read_text()[-4000:]
        raise SystemExit(f"{' '.join(line[:3])} ... failed (exit {done.returncode}); the end of {log}:\n{tail}")
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


@dataclass(frozen=True)
class Settings:
    """What both tools are given."""

    model: str
    classes: int
    image_size: int
    epochs: int
    batch_size: int
    workers: int
    lr: float
    weight_decay: float
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    crop_pct: float = 0.875
    seed: int = 0
    """Each round's own (the round's number), the same for both tools: top-1's spread over rounds
    is then the noise of the data order and augmentation."""


STAGES = ("wait_s", "copy_s", "forward_s", "backward_s", "decode_s", "resize_s", "read_s")
"""raywds's own account of an epoch (metrics.jsonl `stages`, rank 0): the training loop's wait
for batches, the batch's copy and conversion, forward, backward; the loader workers' decode,
resize and read seconds (summed over workers)."""


def run_raywds(shards: Path, weights: Path, s: Settings, out: Path, env: dict[str, str]) -> Run:
    """One `raywds train --mode split` run into `out`, read back from its metrics.jsonl."""
    line = [
        str(RAYWDS), "train", "--data", str(shards), "--model", f"timm/{s.model}",
        "--initial-checkpoint", str(weights), "--mode", "split", "--epochs", str(s.epochs),
        "--batch-size", str(s.batch_size), "--loader-workers", str(s.workers), "--image-size", str(s.image_size),
        "--optimizer", "sgd", "--lr", str(s.lr), "--weight-decay", str(s.weight_decay), "--warmup-epochs", "0",
        "--mean", ",".join(map(str, s.mean)), "--std", ",".join(map(str, s.std)), "--crop-pct", str(s.crop_pct),
        "--seed", str(s.seed), "--out", str(out / "run"),
    ]  # fmt: skip
    run = Run(*timed(line, out / "log.txt", env))
    rows = [json.loads(x) for p in (out / "run").rglob("metrics.jsonl") for x in p.read_text().splitlines()]
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    if len(epochs) != s.epochs:
        raise SystemExit(f"raywds wrote {len(epochs)} epoch rows for {s.epochs} epochs in {out / 'run'}")
    for row in epochs:
        run.samples.append(int(row["train_samples"]))
        run.seconds.append(float(row["stages"]["seconds"][0]))
    run.top1 = float(epochs[-1]["val_top1"])
    later = epochs[1:] or epochs
    for name in STAGES:
        run.notes[name] = statistics.median(float(row["stages"][name][0]) for row in later)
    return run


def run_timm(train_py: Path, shards: Path, weights: Path, s: Settings, out: Path, env: dict[str, str]) -> Run:
    """One run of timm's `train.py` into `out`, read back from its log and summary.csv."""
    line = [
        str(PYTHON), str(train_py), "--data-dir", str(shards), "--dataset", "wds/imagenet",
        "--train-split", "train", "--val-split", "val", "--model", s.model, "--initial-checkpoint", str(weights),
        "--num-classes", str(s.classes), "--img-size", str(s.image_size), "--epochs", str(s.epochs),
        "-b", str(s.batch_size), "-vb", str(s.batch_size), "--workers", str(s.workers),
        "--opt", "sgd", "--momentum", "0.9", "--lr", str(s.lr), "--weight-decay", str(s.weight_decay),
        "--sched", "cosine", "--sched-on-updates", "--warmup-epochs", "0", "--min-lr", "0",
        "--smoothing", "0", "--color-jitter", "0", "--train-interpolation", "bilinear",
        "--interpolation", "bilinear", "--mean", *map(str, s.mean), "--std", *map(str, s.std),
        "--crop-pct", str(s.crop_pct), "--device", "cpu", "--seed", str(s.seed), "--log-interval", "1000",
        "--output", str(out), "--experiment", "run", "--checkpoint-hist", "1",
    ]  # fmt: skip
    run = Run(*timed(line, out / "log.txt", env))
    last: dict[int, re.Match[str]] = {}
    for match in TIMM_STEP.finditer((out / "log.txt").read_text()):
        last[int(match["epoch"])] = match  # the epoch's last line holds its averages over every step
    if len(last) != s.epochs:
        raise SystemExit(f"timm's log has {len(last)} epochs of training lines for {s.epochs}: {out / 'log.txt'}")
    data_wait = []
    for epoch in sorted(last):
        steps = int(last[epoch]["steps"])
        if int(last[epoch]["step"]) != steps - 1:
            raise SystemExit(f"timm's log ends epoch {epoch} at step {last[epoch]['step']} of {steps}: {out}")
        run.samples.append(steps * s.batch_size)  # timm's wds epochs are whole batches
        run.seconds.append(steps * float(last[epoch]["avg"]))
        data_wait.append(steps * float(last[epoch]["data"]))
    with (out / "run" / "summary.csv").open() as f:
        run.top1 = float(list(csv.DictReader(f))[-1]["eval_top1"]) / 100
    run.notes["wait_s"] = statistics.median(data_wait[1:] or data_wait)  # as raywds's: epochs 2..N
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm-train", type=Path, required=True, help="timm's train.py (see above)")
    parser.add_argument("--images", type=Path, default=ROOT.parent / "shared/data/imagenet-sample-100")
    parser.add_argument("--model", default="test_resnet", help="a timm model name (default %(default)s)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--shrink", type=int, default=8, help="average-pool the crops by this before the network")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--train-variants", type=int, default=10, help="training images a photo")
    parser.add_argument("--val-variants", type=int, default=2, help="validation images a photo")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="loader worker processes, both tools")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--weight-decay", type=float, default=5e-5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="keep the data, weights and runs in this new folder")
    args = parser.parse_args()
    if not args.timm_train.is_file():
        raise SystemExit(f"--timm-train {args.timm_train} is not a file: see `--help` for where to get it")
    s = Settings(
        model=args.model, classes=args.classes, image_size=args.image_size, epochs=args.epochs,
        batch_size=args.batch_size, workers=args.workers, lr=args.lr, weight_decay=args.weight_decay,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rwft-", dir="/tmp") as tmp:
        work = args.keep or Path(tmp)
        (work / "site").mkdir(parents=True)
        (work / "site" / "sitecustomize.py").write_text(SHRINK_SITE)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYWDS_"))}
        env.update(
            PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", FINETUNE_BENCH_SHRINK=str(args.shrink),
            PYTHONPATH=os.pathsep.join(filter(None, [str(work / "site"), os.environ.get("PYTHONPATH")])),
        )  # fmt: skip
        count = make_tree(args.images, work / "tree", args.classes, args.train_variants, args.val_variants)
        shards = work / "shards"
        subprocess.run([str(RAYWDS), "convert", str(work / "tree"), str(shards), "--maxcount", "100"], check=True)
        weights = work / f"{args.model}-{args.classes}.safetensors"
        write_weights(args.model, args.classes, weights)
        print(
            f"{count} train images, {args.classes} classes, {os.cpu_count()} CPUs; {args.model},"
            f" {args.image_size} px crops pooled by {args.shrink}"
        )
        runs: dict[str, list[Run]] = {"raywds": [], "timm": []}
        for r in range(args.rounds):
            for tool in ("raywds", "timm") if r % 2 == 0 else ("timm", "raywds"):
                out = work / f"{tool}-{r}"
                out.mkdir(parents=True)
                seeded = dataclasses.replace(s, seed=r)
                load = os.getloadavg()[0]
                if tool == "raywds":
                    run = run_raywds(shards, weights, seeded, out, env)
                else:
                    run = run_timm(args.timm_train, shards, weights, seeded, out, env)
                run.notes["load before"] = load
                run.notes["load after"] = os.getloadavg()[0]
                runs[tool].append(run)
                print(
                    f"  round {r + 1} {tool:6s}: epochs' images/s "
                    + ", ".join(f"{n / t:.1f}" for n, t in zip(run.samples, run.seconds))
                    + f" (samples {run.samples}); run {run.wall:.1f} s, {run.cpu:.1f} CPU s; top-1 {run.top1:.3f}; "
                    + ", ".join(f"{k} {v:.3g}" for k, v in run.notes.items())
                )
        report(runs, args.epochs)


FIGURES = {
    "train images/s": Run.train_rate,
    "run images/s": Run.run_rate,
    "run seconds": lambda r: r.wall,
    "CPU ms a sample": Run.cpu_ms,
    "val top-1": lambda r: r.top1,
}
"""The table's columns: each the median over rounds of one figure of a run."""


def report(runs: dict[str, list[Run]], epochs: int) -> None:
    med = {
        tool: {name: statistics.median(f(r) for r in rs) for name, f in FIGURES.items()} for tool, rs in runs.items()
    }
    names = [f"train images/s (epochs 2-{epochs})", *list(FIGURES)[1:]]
    print(f"\n| tool | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
    for tool, figures in med.items():
        print(
            f"| {tool} | " + " | ".join(f"{v:.3f}" if "top-1" in k else f"{v:.1f}" for k, v in figures.items()) + " |"
        )
    print("| raywds / timm | " + " | ".join(f"{med['raywds'][k] / med['timm'][k]:.2f}x" for k in FIGURES) + " |")
    paired = [a.train_rate() / b.train_rate() for a, b in zip(runs["raywds"], runs["timm"])]
    print(
        f"train images/s raywds / timm, each round: {', '.join(f'{x:.2f}x' for x in paired)}; median"
        f" {statistics.median(paired):.2f}x (goal >= 1.5x at equal top-1)"
    )


if __name__ == "__main__":
    main()
