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
import io
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--images", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-100"
    )
    parser.add_argument("--copies", type=int, default=8)
    args = parser.parse_args()
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
