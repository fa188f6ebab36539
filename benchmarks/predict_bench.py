"""`raywds predict` against Ray Data's documented image batch inference and timm's `inference.py`, and
against raywds's own training loader: images/s on the same photos, with the same model, weights and
preprocessing (resize 256, centre crop 224, ImageNet mean and std), on the same CPUs, in one run.

    .venv/bin/python benchmarks/predict_bench.py [--model timm/test_convnext] [--copies 20] [--repeats 2]
        [--images DIR] [--batch-size 64] [--only raywds,timm,ray,loader,crops]
    .venv/bin/python benchmarks/predict_bench.py --model free     # a model that costs nothing: decoding decides

The photos: the JPEGs in DIR (by default ../shared/data/imagenet-sample-100, 100 real ImageNet photos)
copied --copies times into a folder of class folders (the JPEG folder), which `raywds convert` also
writes as shards of 100 samples. The model: timm's --model NAME (raywds names it timm/NAME) with an
output a class, seed-0 weights written once as a .safetensors file (timm's names) and as a raywds
checkpoint, so every row runs the same weights (there is no Hugging Face Hub here: they are random).
`--model free` is `bench_free`, a timm model this script registers in every process it starts (a
sitecustomize.py on PYTHONPATH): each image pooled to 4 x 4, then one linear layer. On 2 CPUs every
timm model at 224 px costs several times what decoding an image does, so only with it does decoding
decide, as it does where the model runs on a GPU.

Rows, each writing every image's top-5 classes and probabilities to Parquet in a fresh folder, checked
to hold a row per image; W is the CPUs less one (1 on 2 CPUs), the processes that decode, R is CPUs / 2:
  raywds, shards              `raywds predict MODEL --data SHARDS --loader-workers W` as a process
                              (the interpreter's start, imports, the model's loading, writing: all in),
                              its model on the CPUs less W (raywds's own choice); also by its own clock
                              (its last line's seconds: from after its first imports, timm's within)
  raywds, JPEG folder         the same with --data the JPEG folder
  timm inference.py           benchmarks/third_party/timm_inference.py as a process over the JPEG
                              folder: -j W, --checkpoint the .safetensors, --img-size 224 --crop-pct
                              0.875 --interpolation bilinear, ImageNet --mean and --std, --topk 5
                              --include-index --label-type none, --results-format parquet; torch's
                              default threads (every CPU) for the model, as it runs out of the box
  timm, raywds's threads      the same with OMP_NUM_THREADS set to raywds's model threads
  raywds --ray, shards        `raywds predict --ray --data-plane ray` with R model replicas,
                              in this process (the driver) on the private Ray this script starts:
                              Ray's own start is left out, its actors' start is in
  raywds --ray, JPEG folder   the same with --data the JPEG folder
  raywds --ray --data-plane loader, shards
                              R ranks as Ray tasks, each with one loader worker of its own
  Ray Data, JPEG folder       Ray's documented pipeline, "Image Classification Batch Inference with
                              PyTorch" (https://docs.ray.io/en/latest/data/examples/pytorch_resnet_batch_prediction.html):
                              ray.data.read_images(folder, mode="RGB"), a preprocessing map_batches of
                              torchvision's ToTensor, Resize(256), CenterCrop(224), Normalize (the docs'
                              `weights.transforms()`, applied a batch at a time where the docs map each
                              row), map_batches with the model as a class (concurrency R), write_parquet;
                              on the same Ray, in this process
  raywds in this process      `raywds predict` of the shards in this process, W loader workers: from its
                              start (the model's loading, its workers' start) to its last part, as
                              the training loader below is timed (no interpreter start or imports)
  training loader             raywds's training loader (`--decode cpu`, W workers, 224 px random crops)
                              over the shards once, from its start, in this process
  training loader, steady     the same, after its first batch (as benchmarks/loader_bench.py times it)
  full decode                 torchvision.io.decode_jpeg of the photos (3 times), in this process on one
                              thread: one core, no resize
  crop: ...                   one core's rate at each side's per-image work (in this process on one
                              thread, the photos 3 times): raywds's centre crop and its training crop (on the JPEGs as
                              `raywds convert` stores them), timm's loader's (PIL, its eval transform),
                              Ray Data's documented steps (PIL's decode to an array, the transform above)
Each repeat runs every row once, in reverse order every other repeat; the median of --repeats is
reported, with the CPU milliseconds an image (user and system, of every process the row ran, Ray's
workers and actors included): what other work on a shared machine changes least. Ratios: raywds / timm
(processes), raywds --ray / Ray Data (the same Ray), --data-plane ray / loader (the faster should be
`raywds predict --ray`'s default), raywds's predict in this process / the training loader.

Ray's tasks and actors get OMP_NUM_THREADS 1 (Ray sets it to their one CPU): raywds's replicas and
Ray Data's model actors alike. A private local Ray (its own temp dir and token) is started, and
stopped at the end.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow.dataset as pads
import ray
import torch

sys.path.insert(0, str(Path(__file__).parent))
from loader_bench import build_tree, loop_rate, photos, raywds_rate

from raywds.data.convert import ConvertOptions, convert, with_restarts
from raywds.data.manifest import read_manifest
from raywds.infer.predictoptions import Prediction
from raywds.launch.prediction import predict_here
from raywds.launch.ray_prediction import predict_on_ray
from raywds.loader import crops
from raywds.loader.loader import train_loader
from raywds.models.sources import TIMM_PREFIX, parse_model
from raywds.plan.modes import epoch_plan
from raywds.runs.checkpoint import save_checkpoint
from raywds.train.config import TrainConfig
from raywds.world import World

ROOT = Path(__file__).resolve().parents[1]
RAYWDS = ROOT / ".venv/bin/raywds"
TIMM_INFERENCE = Path(__file__).parent / "third_party/timm_inference.py"
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TOP_K = 5
OWN_CLOCK = re.compile(r"predicted \d+ samples .*?\(([\d.]+) s,")
"""`raywds predict`'s last line: its own seconds, from after its imports."""
GROUPS = {
    "raywds": ("raywds, shards", "raywds, JPEG folder"),
    "timm": ("timm inference.py, JPEG folder", "timm, raywds's threads"),
    "ray": (
        "raywds --ray, shards",
        "raywds --ray, JPEG folder",
        "raywds --ray --data-plane loader, shards",
        "Ray Data, JPEG folder",
    ),
    "loader": ("raywds in this process, shards", "training loader", "training loader, steady"),
    "crops": (
        "full decode",
        "crop: raywds centre (shards' JPEGs)",
        "crop: raywds training (shards' JPEGs)",
        "crop: timm's loader",
        "crop: Ray Data's documented steps",
    ),
}
"""--only's names for the rows."""
FREE = "free"
FREE_MODULE = '''"""Written by benchmarks/predict_bench.py: registers the timm model `bench_free` (each image pooled
to 4 x 4, then one linear layer: a model that costs nothing) as this interpreter imports timm."""
import importlib.abc
import importlib.util
import sys


def register(timm):
    from torch import nn

    class Free(nn.Module):
        def __init__(self, num_classes=1000):
            super().__init__()
            self.num_classes = num_classes
            self.pool = nn.AdaptiveAvgPool2d(4)
            self.fc = nn.Linear(48, num_classes)

        def forward(self, x):
            return self.fc(self.pool(x).flatten(1))

    def bench_free(pretrained=False, **kwargs):
        return Free(kwargs.get("num_classes", 1000))

    timm.models.register_model(bench_free)


class AfterTimm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "timm":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            register(module)

        spec.loader.exec_module = exec_module
        return spec


if "timm" in sys.modules:
    register(sys.modules["timm"])
else:
    sys.meta_path.insert(0, AfterTimm())
'''


@dataclass
class Setup:
    """What every row reads: the images, the model, and how many processes decode and score."""

    work: Path
    count: int
    folder: Path
    shards: Path
    arch: str
    checkpoint: Path
    safetensors: Path
    classes: list[str]
    workers: int
    replicas: int
    batch: int
    own: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """raywds's own seconds, by row."""


def free_model(work: Path) -> None:
    """`bench_free` registered with timm here and, through PYTHONPATH, in every process started after."""
    site = work / "site"
    site.mkdir()
    (site / "bench_free_model.py").write_text(FREE_MODULE)
    (site / "sitecustomize.py").write_text("import bench_free_model  # noqa: F401\n")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, str(site))
    importlib.import_module("bench_free_model")


def weights(shards: Path, model: str, work: Path) -> tuple[Path, Path, list[str]]:
    """The model with seed-0 weights, as a raywds checkpoint and as a .safetensors file of timm's names."""
    from safetensors.torch import save_file

    classes = [str(c) for c in read_manifest(str(shards)).classes]
    parsed = parse_model(model)
    torch.manual_seed(0)
    state = parsed.source.build(parsed, len(classes)).state_dict()
    cfg = TrainConfig(data=str(shards), model=model, image_size=224)
    save_checkpoint({"model": state, "classes": classes, "config": cfg.to_dict()}, work / "model.pt")
    save_file({k: v.contiguous() for k, v in state.items()}, str(work / "model.safetensors"))
    return work / "model.pt", work / "model.safetensors", classes


class CpuMeter:
    """CPU seconds (user and system) of this process and every process under it (the commands it runs,
    their loader workers, Ray's workers and actors), read every POLL_S while a row runs: a process that
    ends is counted up to its last reading (Ray does not wait for its actors, so their times never reach
    a parent's children's times)."""

    POLL_S = 0.25

    def __init__(self) -> None:
        self.first: dict[tuple[int, float], float] = {}
        self.last: dict[tuple[int, float], float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)

    def read(self) -> None:
        me = psutil.Process()
        for process in [me, *me.children(recursive=True)]:
            try:
                times = process.cpu_times()
                key = (process.pid, process.create_time())
            except psutil.Error:  # ended since the listing
                continue
            self.first.setdefault(key, 0.0 if self.thread.is_alive() else times.user + times.system)
            self.last[key] = times.user + times.system

    def poll(self) -> None:
        while not self.stop.wait(self.POLL_S):
            self.read()

    def __enter__(self) -> CpuMeter:
        self.read()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.read()

    @property
    def seconds(self) -> float:
        return sum(self.last[key] - self.first[key] for key in self.last)


def settled(cpus: int, timeout: float = 30.0) -> None:
    """Wait until the last row's Ray actors have given back their CPUs, so that the next row has them all."""
    deadline = time.monotonic() + timeout
    while ray.is_initialized() and ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)


def whole(run: Callable[[Path], Any], setup: Setup, out: Path) -> float:
    """Images per second of one run into a fresh `out`, checked to have written a row per image."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    run(out)
    seconds = time.perf_counter() - start
    written = pads.dataset(str(out), format="parquet").count_rows()
    if written != setup.count:
        raise SystemExit(f"{out.name}: wrote {written} rows for {setup.count} images")
    return setup.count / seconds


def command(argv: list[str], out: Path, env: dict[str, str] | None = None, own: list[float] | None = None) -> None:
    """`argv` as a process, `{out}` in it replaced by `out`, with `env` added to the environment; its
    output shown only where it fails; with `own`, raywds's own seconds (its last line) appended."""
    argv = [a.replace("{out}", str(out)) for a in argv]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode:
        raise SystemExit(f"{' '.join(argv[:3])} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    said = OWN_CLOCK.search(done.stdout + done.stderr)
    if own is not None and said:
        own.append(float(said.group(1)))


def raywds_argv(setup: Setup, data: Path) -> list[str]:
    return [
        *(str(RAYWDS), "predict", str(setup.checkpoint), "--data", str(data), "--out", "{out}"),
        *("--loader-workers", str(setup.workers), "--batch-size", str(setup.batch)),
    ]


def timm_argv(setup: Setup) -> list[str]:
    return [
        *(sys.executable, str(TIMM_INFERENCE), "--data-dir", str(setup.folder), "--model", setup.arch),
        *("--checkpoint", str(setup.safetensors), "--num-classes", str(len(setup.classes)), "--device", "cpu"),
        *("-j", str(setup.workers), "-b", str(setup.batch), "--img-size", "224", "--crop-pct", "0.875"),
        *("--interpolation", "bilinear", "--mean", *map(str, MEAN), "--std", *map(str, STD)),
        *("--topk", str(TOP_K), "--include-index", "--label-type", "none", "--log-freq", "1000"),
        *("--results-dir", "{out}", "--results-format", "parquet", "--no-console-results"),
    ]


def on_ray(setup: Setup, data: Path, out: Path, plane: str = "ray") -> None:
    """`raywds predict MODEL --data DATA --out OUT --ray --data-plane PLANE --num-workers R` on the Ray this
    process is connected to (`loader`: R ranks as Ray tasks of one loader worker each)."""
    job = Prediction(model=str(setup.checkpoint), data=str(data), out=str(out))
    workers = setup.workers if plane == "ray" else 1
    predict_on_ray(job, {"batch_size": setup.batch, "loader_workers": workers}, plane, None, setup.replicas)


def preprocess(batch: dict[str, Any]) -> dict[str, Any]:
    """Ray Data's preprocessing: the docs' ImageNet transform, image by image, a batch at a time."""
    from torchvision import transforms

    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Resize(256), transforms.CenterCrop(224), transforms.Normalize(MEAN, STD)]
    )
    return {"path": batch["path"], "transformed_image": np.stack([transform(i).numpy() for i in batch["image"]])}


class Classifier:
    """Ray Data's model actor (the docs' ResnetModel): the same timm model and weights; top-k with names."""

    def __init__(self, arch: str, weights: str, classes: list[str]):
        import timm

        self.model = timm.create_model(arch, pretrained=False, num_classes=len(classes), checkpoint_path=weights)
        self.model.eval()
        self.classes = np.array(classes)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import torch  # here: a module-level name would have Ray pickle this class with torch's own objects

        with torch.inference_mode():
            top = self.model(torch.from_numpy(batch["transformed_image"])).softmax(dim=1).topk(TOP_K, dim=1)
        classes = top.indices.numpy()
        return {
            "path": batch["path"],
            "top_classes": classes,
            "top_names": self.classes[classes],
            "top_probs": top.values.numpy(),
        }


def ray_data(setup: Setup, out: Path) -> None:
    ds = ray.data.read_images(str(setup.folder), mode="RGB", include_paths=True)
    ds = ds.map_batches(preprocess)
    ds = ds.map_batches(
        Classifier,
        fn_constructor_args=(setup.arch, str(setup.safetensors), setup.classes),
        concurrency=setup.replicas,
        batch_size=setup.batch,
    )
    ds.write_parquet(str(out))


def here(setup: Setup, out: Path) -> None:
    """`raywds predict` of the shards in this process (its imports done): W loader workers."""
    job = Prediction(model=str(setup.checkpoint), data=str(setup.shards), out=str(out))
    predict_here(job, {"batch_size": setup.batch, "loader_workers": setup.workers})


def timm_crop() -> Callable[[bytes], Any]:
    """An image as timm's loader makes it for inference.py: PIL opens it as RGB, timm's eval transform
    (Resize 256 bilinear, CenterCrop 224, uint8 out; its prefetcher normalises whole batches later)."""
    from timm.data import create_transform

    transform = create_transform(224, crop_pct=0.875, interpolation="bilinear", use_prefetcher=True)
    return lambda data: transform(crops.open_rgb(data))


def ray_data_crop(data: bytes) -> Any:
    """An image as Ray Data's documented pipeline makes it: read_images' PIL decode to an RGB array, then
    the preprocessing step's transform."""
    return preprocess({"path": [""], "image": [np.asarray(crops.open_rgb(data))]})


def one_thread(rate: Callable[[], float]) -> float:
    """`rate()` with torch on one thread, as a loader worker or a one-CPU Ray task runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return rate()
    finally:
        torch.set_num_threads(before)


def loader_pass(setup: Setup) -> float:
    """raywds's training loader over the shards once, from its start (its workers' included), in images/s."""
    cfg = TrainConfig(
        data=str(setup.shards), model="demo", batch_size=setup.batch, loader_workers=setup.workers, image_size=224
    )
    manifest = read_manifest(str(setup.shards))
    plan = epoch_plan(manifest, cfg, 1, epoch=0)
    start, seen = time.perf_counter(), 0
    for batch in train_loader(manifest, cfg.loader(), World(), plan, epoch=0):
        seen += len(batch[0])
    return seen / (time.perf_counter() - start)


def rows(setup: Setup, images: list[Path]) -> dict[str, tuple[Callable[[], float], int]]:
    """Every row: a call that runs it once and gives its images/s, and the images it handles."""
    work, decodes, n = setup.work, [p.read_bytes() for p in images] * 3, setup.count
    stored = [with_restarts(d) for d in decodes]  # as `raywds convert` writes them into shards
    centre = partial(crops.val_crop, size=224, resize=256)
    train = partial(crops.train_crop, size=224, scale=(0.08, 1.0))
    threads = {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) - setup.workers))}

    def cli(data: Path, name: str) -> Callable[[Path], None]:
        return partial(command, raywds_argv(setup, data), own=setup.own[name])

    return {
        "raywds, shards": (partial(whole, cli(setup.shards, "raywds, shards"), setup, work / "o1"), n),
        "raywds, JPEG folder": (partial(whole, cli(setup.folder, "raywds, JPEG folder"), setup, work / "o2"), n),
        "timm inference.py, JPEG folder": (partial(whole, partial(command, timm_argv(setup)), setup, work / "o3"), n),
        "timm, raywds's threads": (
            partial(whole, partial(command, timm_argv(setup), env=threads), setup, work / "o4"),
            n,
        ),
        "raywds --ray, shards": (partial(whole, partial(on_ray, setup, setup.shards), setup, work / "o5"), n),
        "raywds --ray, JPEG folder": (partial(whole, partial(on_ray, setup, setup.folder), setup, work / "o6"), n),
        "raywds --ray --data-plane loader, shards": (
            partial(whole, partial(on_ray, setup, setup.shards, plane="loader"), setup, work / "o8"),
            n,
        ),
        "Ray Data, JPEG folder": (partial(whole, partial(ray_data, setup), setup, work / "o7"), n),
        "raywds in this process, shards": (partial(whole, partial(here, setup), setup, work / "o9"), n),
        "training loader": (partial(loader_pass, setup), n),
        "training loader, steady": (partial(raywds_rate, setup.shards, setup.workers, n, 224, "cpu"), n),
        "full decode": (partial(one_thread, partial(loop_rate, decodes, crops.jpeg_tensor)), len(decodes)),
        "crop: raywds centre (shards' JPEGs)": (partial(one_thread, partial(loop_rate, stored, centre)), len(decodes)),
        "crop: raywds training (shards' JPEGs)": (partial(one_thread, partial(loop_rate, stored, train)), len(decodes)),
        "crop: timm's loader": (partial(one_thread, partial(loop_rate, decodes, timm_crop())), len(decodes)),
        "crop: Ray Data's documented steps": (
            partial(one_thread, partial(loop_rate, decodes, ray_data_crop)),
            len(decodes),
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, default=ROOT.parent / "shared/data/imagenet-sample-100")
    parser.add_argument("--copies", type=int, default=20, help="copies of each photo (default %(default)s)")
    parser.add_argument("--model", default="timm/test_convnext", help=f"timm/NAME, or {FREE} (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every row (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=64, help="images a batch, every row (default %(default)s)")
    parser.add_argument("--only", default=",".join(GROUPS), help="the rows to run (default %(default)s)")
    args = parser.parse_args()
    if args.model != FREE and not args.model.startswith(TIMM_PREFIX):
        parser.error(f"--model {args.model}: give timm/NAME, which timm's inference.py builds too, or {FREE}")
    chosen = [row for group in args.only.split(",") for row in GROUPS[group]]
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
        model = args.model
        if model == FREE:
            free_model(work)
            model = f"{TIMM_PREFIX}bench_free"
        images = photos(args.images, work / "generated")
        count = build_tree(images, args.copies, work / "tree")
        convert(work / "tree", work / "shards", ConvertOptions(maxcount=100, seed=0))
        checkpoint, safetensors, classes = weights(work / "shards", model, work)
        cpus = len(os.sched_getaffinity(0))
        setup = Setup(
            work=work,
            count=count,
            folder=work / "tree/train",
            shards=work / "shards",
            arch=model[len(TIMM_PREFIX) :],
            checkpoint=checkpoint,
            safetensors=safetensors,
            classes=classes,
            workers=max(1, cpus - 1),
            replicas=max(1, cpus // 2),
            batch=args.batch_size,
        )
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, _temp_dir=str(work / "ray"))
        try:
            ray.data.DataContext.get_current().enable_progress_bars = False
            runs = {name: row for name, row in rows(setup, images).items() if name in chosen}
            print(
                f"{count} images ({len(images)} photos x {args.copies}) as {len(list(setup.shards.glob('*.tar')))} "
                f"shards and a JPEG folder; {cpus} CPUs: {setup.workers} decoding worker(s), {setup.replicas} Ray "
                f"model replica(s); --model {args.model}, batch {setup.batch}; median of {args.repeats}",
                flush=True,
            )
            rates: dict[str, list[float]] = defaultdict(list)
            cpu: dict[str, list[float]] = defaultdict(list)
            for repeat in range(args.repeats):
                print(f"repeat {repeat + 1}: load average {os.getloadavg()[0]:.1f}", flush=True)
                for name in list(runs) if repeat % 2 == 0 else list(reversed(runs)):
                    run, handled = runs[name]
                    settled(cpus)
                    with CpuMeter() as meter:
                        rates[name].append(run())
                    cpu[name].append(meter.seconds * 1000 / handled)
                    print(
                        f"  {name:40s} {rates[name][-1]:7.1f} images/s  {cpu[name][-1]:6.1f} CPU ms an image",
                        flush=True,
                    )
            print(f"load average at the end {os.getloadavg()[0]:.1f}")
            report(rates, cpu, setup)
        finally:
            ray.shutdown()
            Path(os.environ["RAYWDS_BENCH_TOKEN"]).unlink(missing_ok=True)


RATIOS = {
    "raywds / timm inference.py, JPEG folder": ("raywds, JPEG folder", "timm inference.py, JPEG folder"),
    "raywds / timm with raywds's threads": ("raywds, JPEG folder", "timm, raywds's threads"),
    "raywds (shards) / timm inference.py": ("raywds, shards", "timm inference.py, JPEG folder"),
    "raywds --ray / Ray Data, JPEG folder": ("raywds --ray, JPEG folder", "Ray Data, JPEG folder"),
    "raywds --ray (shards) / Ray Data": ("raywds --ray, shards", "Ray Data, JPEG folder"),
    "--data-plane ray / loader, shards": ("raywds --ray, shards", "raywds --ray --data-plane loader, shards"),
    "raywds in this process / training loader": ("raywds in this process, shards", "training loader"),
    "the same / training loader, steady": ("raywds in this process, shards", "training loader, steady"),
    "crop, one core: raywds centre / timm's": ("crop: raywds centre (shards' JPEGs)", "crop: timm's loader"),
    "crop, one core: raywds centre / Ray Data's": (
        "crop: raywds centre (shards' JPEGs)",
        "crop: Ray Data's documented steps",
    ),
    "crop, one core: raywds centre / training": (
        "crop: raywds centre (shards' JPEGs)",
        "crop: raywds training (shards' JPEGs)",
    ),
}


def report(rates: dict[str, list[float]], cpu: dict[str, list[float]], setup: Setup) -> None:
    for name, seconds in setup.own.items():
        if seconds:
            rates[f"{name}, own clock"] = [setup.count / s for s in seconds]
    rate = {name: statistics.median(values) for name, values in rates.items()}
    print("images/s, median (the repeats); CPU ms an image, median:")
    for name, value in rate.items():
        spread = ", ".join(f"{v:.1f}" for v in rates[name])
        spent = f"{statistics.median(cpu[name]):6.1f}" if name in cpu else ""
        print(f"  {name:40s} {value:7.1f} ({spread})  {spent}")
    print("ratios of the medians: images/s (and CPU ms an image, the other way up):")
    for label, (top, bottom) in RATIOS.items():
        if top in rate and bottom in rate:
            spent = f" ({statistics.median(cpu[bottom]) / statistics.median(cpu[top]):.2f}x)" if top in cpu else ""
            print(f"  {label:46s} {rate[top] / rate[bottom]:5.2f}x{spent}")


if __name__ == "__main__":
    main()
