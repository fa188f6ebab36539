"""Convert throughput on real ImageNet JPEGs, and the cost of the integrity check.

    .venv/bin/python benchmarks/convert_bench.py [--images ../shared/data/imagenet-sample-100] [--copies 8]

Builds a tree of `copies` x the sample images (train/<wnid>/...), then converts it with 1 worker
(the baseline) and with 2, in the same run, and with 1 worker and `--keep-jpeg-bytes` (no
restart markers added: what that step costs, and how much bigger the shards are with them);
then again each in a fresh process, as `raywds convert` runs, so the time to import
raywds.data.convert counts too (and what it imports: it should not be torch); and times per
image: header parse only (baseline), the draft-mode decode `convert` does, a full decode, and
adding restart markers (`with_restarts`).

    .venv/bin/python benchmarks/convert_bench.py --ray [--copies 8] [--workers 2] [--repeat 3]

With `--ray`, instead: the same tree converted, each variant `--repeat` times in turn, by
`raywds convert --workers N` (the baseline), `raywds convert --ray` on a private local cluster of
N CPUs (`ray start --head`, its own temp dir, ports and token, started before and not timed) and
on a two-node cluster (tests/support/netnodes.py: 1 CPU each, network namespaces, needs root),
and litdata's optimize() with N workers (raw bytes; and also checking each image with PIL); a
markdown table of the medians, the --ray shards checked byte for byte against the local ones,
and the shards each node wrote. The clusters not in use are stopped (SIGSTOP) meanwhile.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from PIL import Image

from raywds.data.convert import ConvertOptions, convert, inspect_image, with_restarts


def shard_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.tar"))


def build_tree(images: list[Path], copies: int, root: Path) -> int:
    total = 0
    for path in images:
        wnid = path.name.split("_")[0]
        folder = root / "train" / wnid
        folder.mkdir(parents=True, exist_ok=True)
        for c in range(copies):
            shutil.copy(path, folder / f"{path.stem}_{c}.JPEG")
            total += path.stat().st_size
    return total


FRESH = """
import sys, time
start = time.perf_counter()
from pathlib import Path
from raywds.data.convert import ConvertOptions, convert
imported = time.perf_counter() - start
if len(sys.argv) > 1:
    convert(Path(sys.argv[1]), Path(sys.argv[2]), ConvertOptions(maxcount=100, workers=int(sys.argv[3])))
print(imported, "torch" in sys.modules, "webdataset" in sys.modules)
"""


def fresh_process(*args: str) -> tuple[float, float, str]:
    """(wall seconds, seconds importing raywds.data.convert, heavy modules it imported) in a new interpreter."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", FRESH, *args], check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    imported, torch, wds = run.stdout.split()
    heavy = [name for name, loaded in (("torch", torch), ("webdataset", wds)) if loaded == "True"]
    return seconds, float(imported), ", ".join(heavy) or "neither torch nor webdataset"


def per_image_ms(datas: list[bytes], check: str) -> float:
    start = time.perf_counter()
    for data in datas:
        if check == "header":
            with Image.open(io.BytesIO(data)) as img:
                _ = img.size  # the header only: Image.open reads no pixels
        elif check == "draft":
            inspect_image(data)
        elif check == "restarts":
            with_restarts(data)
        else:
            with Image.open(io.BytesIO(data)) as img:
                img.load()
    return (time.perf_counter() - start) / len(datas) * 1e3


# --- `--ray`: raywds convert on Ray clusters, and litdata's optimize(), against the local converter ---

ROOT = Path(__file__).resolve().parents[1]
RAYWDS_CLI = """
import sys, time
marks = {}
def timed(module, name):
    real = getattr(module, name)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            marks[name] = marks.get(name, 0.0) + time.perf_counter() - start
    setattr(module, name, wrapper)
import raywds.data.convert
timed(raywds.data.convert, "convert")
if "--ray" in sys.argv:
    import raywds.launch.cluster
    timed(raywds.launch.cluster, "connect")
    timed(raywds.launch.cluster, "check_every_node_sees")
from raywds.cli.main import main
code = main(sys.argv[1:])
print("BENCH", *(f"{k}={v:.4f}" for k, v in marks.items()), f"end={time.time():.6f}")
sys.exit(code)
"""
"""`raywds convert ARGS` as the console script runs it (raywds.cli.main), timing the conversion
(raywds.data.convert.convert: scan, plan, shards, manifest), with --ray ray.init and the check
that every node sees SRC and OUT (a task on each node, where there are two or more), and saying
when it returned (the rest, to the process's end, is Ray's shutdown at exit)."""

LITDATA_JOB = """
import io, sys, time
from pathlib import Path
from litdata import optimize
from PIL import Image

def raw(item):
    path, label = item
    return {"image": Path(path).read_bytes(), "label": label}

def checked(item):
    sample = raw(item)
    with Image.open(io.BytesIO(sample["image"])) as img:
        img.verify()  # for a JPEG, the header only
    with Image.open(io.BytesIO(sample["image"])) as img:
        img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
        img.load()  # the 1/8-scale decode raywds checks each image with (raywds.data.convert.inspect_image)
    return sample

if __name__ == "__main__":
    src, out, workers, chunk_bytes, check = sys.argv[1:6]
    train = Path(src) / "train"
    classes = sorted(p.name for p in train.iterdir())
    inputs = [(str(p), i) for i, c in enumerate(classes) for p in sorted((train / c).iterdir())]
    start = time.perf_counter()
    fn = checked if check == "pil" else raw
    optimize(fn=fn, inputs=inputs, output_dir=out, num_workers=int(workers), chunk_bytes=int(chunk_bytes),
             verbose=False)
    print(f"BENCH convert={time.perf_counter() - start:.4f} end={time.time():.6f}")
"""
"""litdata's optimize() on the tree's train/ images: {"image": the file's bytes, "label": class index}."""


@dataclasses.dataclass
class Variant:
    name: str
    command: Callable[[Path], list[str]]
    """The command line that converts into the given folder."""
    run: Callable[[list[str], float], subprocess.CompletedProcess[str]]
    clusters: tuple[Path, ...] = ()
    """The temp dirs of the Ray clusters it uses (the others are stopped while it runs)."""
    shards: bool = True
    """Whether it writes raywds shards (checked against the local converter's)."""
    walls: list[float] = dataclasses.field(default_factory=list)
    marks: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    same: list[bool] = dataclasses.field(default_factory=list)
    nodes: list[str] = dataclasses.field(default_factory=list)


def local_run(env: dict[str, str]) -> Callable[[list[str], float], subprocess.CompletedProcess[str]]:
    def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)

    return run


def time_once(variant: Variant, out: Path, timeout: float) -> str:
    """Run `variant` once into `out` and record its times; its output."""
    start = time.perf_counter()
    done = variant.run(variant.command(out), timeout)
    wall, finished = time.perf_counter() - start, time.time()
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{variant.name} exited {done.returncode}:\n{output[-4000:]}")
    variant.walls.append(wall)
    marks = next(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("BENCH "))
    for mark in marks:
        name, value = mark.split("=")
        seconds = finished - float(value) if name == "end" else float(value)
        variant.marks.setdefault("exit" if name == "end" else name, []).append(seconds)
    nodes = re.search(r"^written by Ray tasks on .*$", done.stdout, re.M)
    if nodes:
        variant.nodes.append(nodes.group(0))
    return output


def same_shards(reference: Path, out: Path) -> bool:
    """Whether `out` holds the same .tar files as `reference`, byte for byte."""
    mine, theirs = sorted(reference.glob("*.tar")), sorted(out.glob("*.tar"))
    if [p.name for p in mine] != [p.name for p in theirs]:
        return False
    return all(a.read_bytes() == b.read_bytes() for a, b in zip(mine, theirs))


@contextmanager
def local_cluster(root: Path, cpus: int, env: dict[str, str]) -> Iterator[Any]:
    """`ray start --head --num-cpus CPUS` on its own temp dir, ports and token (a token_hex(32)
    file, mode 0600, in the temp dir), stopped by PID at the end (tests/support/raycluster.py)."""
    from support.raycluster import head_node

    temp = Path(tempfile.mkdtemp(prefix="l", dir=root))
    with head_node(temp, env=env, num_cpus=cpus) as head:
        yield head


@contextmanager
def two_node_cluster(root: Path, env: dict[str, str]) -> Iterator[Any]:
    """tests/support/netnodes.py's two nodes (1 CPU each), their temp dirs under `root`; None
    (and why) where namespaces cannot be made here."""
    from support import netnodes, raycluster

    why = netnodes.available()
    if why is not None:
        print(f"two-node cluster skipped: {why}")
        yield None
        return

    @contextmanager
    def ray_temp_dir(prefix: str) -> Iterator[Path]:  # netnodes' own, under /tmp
        temp = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        try:
            yield temp
        finally:
            raycluster.stop_cluster(temp)
            shutil.rmtree(temp, ignore_errors=True)

    netnodes.ray_temp_dir = ray_temp_dir
    with netnodes.two_nodes("n", env=env) as cluster:
        yield cluster


def litdata_available(env: dict[str, str]) -> str | None:
    """Why litdata cannot be run here, or None."""
    done = subprocess.run([sys.executable, "-c", "import litdata"], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1]
        return f"litdata is not installed ({last}): `.venv/bin/uv pip install --python .venv/bin/python litdata`"
    return None


def raywds_line(src: Path, args: argparse.Namespace, *extra: str) -> Callable[[Path], list[str]]:
    """`raywds convert SRC OUT` with the benchmark's settings and `extra`, for an OUT."""
    common = ["--maxcount", str(args.maxcount), "--seed", "0", *extra]
    return lambda out: [sys.executable, "-c", RAYWDS_CLI, "convert", str(src), str(out), *common]


def litdata_line(job: Path, src: Path, args: argparse.Namespace, check: str) -> Callable[[Path], list[str]]:
    return lambda out: [sys.executable, str(job), str(src), str(out), str(args.workers), str(args.chunk_bytes), check]


def variants(args: argparse.Namespace, src: Path, root: Path, stack: ExitStack, env: dict[str, str]) -> list[Variant]:
    """The baseline first, then each variant that can run here (its cluster started now, into `stack`)."""
    n, here = args.workers, local_run(env)
    found = [Variant(f"`convert --workers {n}` (baseline)", raywds_line(src, args, "--workers", str(n)), here)]
    started = time.perf_counter()
    head = stack.enter_context(local_cluster(root, n, env))
    print(f"local cluster of {n} CPUs started in {time.perf_counter() - started:.1f} s (not counted)")
    ray_here = raywds_line(src, args, "--ray", "--address", head.gcs_address)
    found.append(
        Variant(f"`convert --ray`, local cluster of {n} CPUs", ray_here, local_run(head.env), (head.temp_dir,))
    )
    started = time.perf_counter()
    two = stack.enter_context(two_node_cluster(root, env))
    if two is not None:
        print(f"two-node cluster started in {time.perf_counter() - started:.1f} s (not counted)")
        ray_two = raywds_line(src, args, "--ray", "--address", two.gcs_address)

        def on_head(line: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
            return two.run(line, timeout=timeout)

        found.append(
            Variant("`convert --ray`, 2 nodes of 1 CPU", ray_two, on_head, (two.head.temp_dir, two.worker_temp))
        )
    why = litdata_available(env)
    if why is not None:
        print(f"litdata rows skipped: {why}")
        return found
    job = root / "litdata_job.py"
    job.write_text(LITDATA_JOB)
    for check, what in (("raw", "raw bytes"), ("pil", "PIL verify + draft decode")):
        line = litdata_line(job, src, args, check)
        found.append(Variant(f"litdata `optimize`, {n} workers, fn: {what}", line, here, shards=False))
    return found


def measure(found: list[Variant], reference: Path, root: Path, repeat: int, timeout: float) -> None:
    """Each variant `repeat` times, in turn, into a new folder each time (removed after), the Ray
    clusters it does not use stopped (SIGSTOP) meanwhile, so that their idle polling takes no CPU."""
    from support.raycluster import frozen

    clusters = {temp for variant in found for temp in variant.clusters}
    for i in range(repeat):
        for number, variant in enumerate(found):
            out = root / "out" / f"{number}-{i}"
            with ExitStack() as idle:
                for temp in sorted(clusters - set(variant.clusters)):
                    idle.enter_context(frozen(temp))
                time_once(variant, out, timeout)
            if variant.shards:
                variant.same.append(same_shards(reference, out))
            shutil.rmtree(out, ignore_errors=True)
            print(f"  run {i + 1}/{repeat} {variant.name}: {variant.walls[-1]:.2f} s", file=sys.stderr, flush=True)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def report(found: list[Variant], num_files: int) -> None:
    """The markdown table of medians, then the shard checks and each node's shards."""
    base_wall, base_convert = median(found[0].walls), median(found[0].marks["convert"])
    assert base_wall is not None and base_convert is not None
    columns = "wall s | connect s | node check s | conversion s | exit s | files/s | speed (wall) | speed (conv.)"
    print(f"\n| variant | {columns} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v in found:
        wall, conv = median(v.walls), median(v.marks["convert"])
        assert wall is not None and conv is not None
        steps = [cell(median(v.marks.get(name, []))) for name in ("connect", "check_every_node_sees")]
        print(
            f"| {v.name} | {wall:.2f} | {' | '.join(steps)} | {conv:.2f} | {cell(median(v.marks['exit']))} | "
            f"{num_files / conv:.0f} | {base_wall / wall:.2f}x | {base_convert / conv:.2f}x |"
        )
    print(
        "\nwall: the whole command (interpreter, imports, connecting, conversion, Ray's shutdown at exit); "
        "the clusters were started before and are not counted. connect: ray.init to the running cluster. "
        "node check: the task on each node that checks it sees SRC and OUT (only with 2+ nodes; it starts a "
        "worker on each, which the conversion then uses). conversion: raywds.data.convert.convert (scan, plan, "
        "shards, manifest), or litdata's optimize() call; files/s from it. exit: from the command's return to "
        "its process's end. speed: the baseline's median seconds / the row's (>1: faster than the baseline)."
    )
    for v in found[1:]:
        if v.shards:
            verdict = "byte-identical" if all(v.same) else "DIFFERENT"
            print(f"{v.name}: shards {verdict} to the local converter's in {sum(v.same)}/{len(v.same)} runs")
    for v in found:
        for number, line in enumerate(v.nodes, 1):
            print(f"{v.name}, run {number}: {line}")


def ray_main(args: argparse.Namespace) -> None:
    images = sorted(args.images.glob("*.JPEG"))
    home_ray = (Path.home() / ".ray").exists()
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="rwb-"))  # short: Ray's socket paths under it have a length limit
    try:
        src, reference, tmp = root / "src", root / "reference", root / "tmp"
        tmp.mkdir()
        tempfile.tempdir = str(tmp)  # multiprocessing's pymp-* folders of the reference conversion
        env = {**os.environ, "TMPDIR": str(tmp), "DATA_OPTIMIZER_CACHE_FOLDER": str(tmp / "chunks")}
        env["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(tmp / "data")
        num_bytes = build_tree(images, args.copies, src)
        num_files = len(images) * args.copies
        # Untimed: the shards the others are checked against, litdata's chunk size, a warm page cache.
        convert(src, reference, ConvertOptions(maxcount=args.maxcount, workers=args.workers))
        args.chunk_bytes = shard_bytes(reference) // len(list(reference.glob("*.tar")))
        print(
            f"{num_files} JPEGs, {num_bytes / 1e6:.1f} MB; --maxcount {args.maxcount}: "
            f"{len(list(reference.glob('*.tar')))} shards of {args.chunk_bytes / 1e6:.1f} MB on average "
            f"(litdata's chunk_bytes); {os.cpu_count()} CPUs here; {args.repeat} runs each"
        )
        sys.path.insert(0, str(ROOT / "tests"))  # tests/support: the private Ray clusters
        with ExitStack() as stack:
            found = variants(args, src, root, stack, env)
            measure(found, reference, root, args.repeat, timeout=120 + num_files)
        report(found, num_files)
    finally:
        tempfile.tempdir = None
        shutil.rmtree(root, ignore_errors=True)
    if not home_ray and (Path.home() / ".ray").exists():
        print(f"warning: {Path.home() / '.ray'} was created during the benchmark")
    print(f"benchmark took {time.perf_counter() - started:.0f} s")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    )
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--ray", action="store_true", help="raywds convert --ray and litdata against --workers N")
    parser.add_argument("--workers", type=int, default=2, help="with --ray: workers, and the local cluster's CPUs")
    parser.add_argument("--repeat", type=int, default=3, help="with --ray: runs of each variant")
    parser.add_argument("--maxcount", type=int, default=100, help="with --ray: samples per shard")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.ray:
        ray_main(args)
        return
    images = sorted(args.images.glob("*.JPEG"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        num_bytes = build_tree(images, args.copies, root / "src")
        num_files = len(images) * args.copies
        print(f"{num_files} JPEGs, {num_bytes / 1e6:.1f} MB")
        rates = {}
        for workers in (1, 2):
            start = time.perf_counter()
            convert(root / "src", root / f"out{workers}", ConvertOptions(maxcount=100, workers=workers))
            seconds = time.perf_counter() - start
            rates[workers] = num_files / seconds
            print(
                f"convert --workers {workers}: {seconds:.2f} s  {num_files / seconds:.0f} files/s  "
                f"{num_bytes / seconds / 1e6:.1f} MB/s"
            )
        print(f"ratio workers 2 / workers 1: {rates[2] / rates[1]:.2f}x")
        start = time.perf_counter()
        kept = ConvertOptions(maxcount=100, workers=1, keep_jpeg_bytes=True)
        convert(root / "src", root / "kept", kept)
        seconds = time.perf_counter() - start
        print(
            f"convert --workers 1 --keep-jpeg-bytes: {seconds:.2f} s  {num_files / seconds:.0f} files/s; "
            f"restart markers / bytes kept: {rates[1] / (num_files / seconds):.2f}x the files/s, "
            f"{shard_bytes(root / 'out1') / shard_bytes(root / 'kept'):.4f}x the shards' bytes"
        )
        seconds, imported, heavy = fresh_process()
        print(
            f"fresh process, import raywds.data.convert only: {seconds:.2f} s (import {imported:.2f} s; loads {heavy})"
        )
        for workers in (1, 2):
            seconds, imported, _ = fresh_process(str(root / "src"), str(root / f"fresh{workers}"), str(workers))
            rates[workers] = num_files / seconds
            print(
                f"fresh process convert --workers {workers}: {seconds:.2f} s  {rates[workers]:.0f} files/s  "
                f"(import {imported:.2f} s)"
            )
        print(f"fresh process ratio workers 2 / workers 1: {rates[2] / rates[1]:.2f}x")
    datas = [p.read_bytes() for p in images] * 3
    cost = {check: per_image_ms(datas, check) for check in ("header", "draft", "full", "restarts")}
    for check, ms in cost.items():
        print(f"check {check:6s}: {ms:.2f} ms/image  ({ms / cost['header']:.1f}x header only)")
    print(f"draft / full decode: {cost['draft'] / cost['full']:.2f}")


if __name__ == "__main__":
    main()
