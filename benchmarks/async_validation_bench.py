"""`raywds ray --async-validation` against in-loop validation, as a user runs them: the same shards
of real photos, the same model and flags, on a private local Ray of the run's own (its own temp dir
and token), the whole `raywds ray` command timed (its start, every epoch, every validation and the
wait for the last). The val split is as large as the train split here, so validation is a large
share of each epoch, as in this repository's Ray tests.

    .venv/bin/python benchmarks/async_validation_bench.py [--images DIR] [--copies 4] [--epochs 3] [--repeats 2]
        [--workers 1] [--loader-workers 1] [--model resnet18]

Rows (each the median of --repeats whole runs, alternating):
  in-loop   the ranks validate each epoch's end, then train the next
  apart     --async-validation: a Ray task validates each epoch's checkpoint while the ranks train on
Also printed: the epochs' own images/s (the training alone), which a validation task that shares
the machine's cores slows.

The shards: the photos in DIR (by default ../shared/data/imagenet-sample-100, real ImageNet JPEGs)
copied --copies times into a train and a val split, converted by raywds into shards of 100 samples.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from loader_bench import photos

from raywds.data.convert import ConvertOptions, convert

ROOT = Path(__file__).resolve().parents[1]
MODES = {"in-loop": [], "apart": ["--async-validation"]}


def build(images: list[Path], copies: int, root: Path) -> int:
    """`copies` copies of each photo in a train and in a val split of class folders."""
    for split in ("train", "val"):
        for path in images:
            folder = root / split / path.name.split("_")[0]
            folder.mkdir(parents=True, exist_ok=True)
            for c in range(copies):
                shutil.copy(path, folder / f"{path.stem}_{c}.JPEG")
    return len(images) * copies


def run(shards: Path, mode: str, args: argparse.Namespace, work: Path) -> tuple[float, list[float], list[float]]:
    """One `raywds ray` run: (wall-clock seconds, each epoch's training images/s, each validation's seconds)."""
    temp = Path(tempfile.mkdtemp(prefix="r", dir=work))
    token = temp / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_TMPDIR=str(temp), RAY_ADDRESS="local",
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
    )  # fmt: skip
    line = [
        str(ROOT / ".venv/bin/raywds"), "ray", "--data", str(shards), "--model", args.model, "--mode", "split",
        "--image-size", "160", "--batch-size", "32", "--epochs", str(args.epochs), "--num-workers", str(args.workers),
        "--loader-workers", str(args.loader_workers), "--storage-path", str(temp / "runs"), "--name", mode,
        *MODES[mode],
    ]  # fmt: skip
    started = time.perf_counter()
    out = subprocess.run(line, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"raywds ray ({mode}) failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for p in (temp / "runs").rglob("metrics.jsonl") for line in p.read_text().splitlines()]
    shutil.rmtree(temp, ignore_errors=True)
    rates = [r["images_per_s"] for r in rows if r.get("kind") == "epoch"]
    validations = [r["validation_s"] for r in rows if r.get("kind") == "validation"]
    if mode == "apart" and len(validations) != args.epochs:
        raise SystemExit(f"--async-validation landed {len(validations)} validations of {args.epochs} epochs")
    return seconds, rates, validations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, default=ROOT.parent / "shared/data/imagenet-sample-100")
    parser.add_argument("--copies", type=int, default=4, help="copies of each photo per split (default %(default)s)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1, help="training workers (default %(default)s)")
    parser.add_argument("--loader-workers", type=int, default=1, help="each rank's (default %(default)s)")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rwav-", dir="/tmp") as tmp:
        work = Path(tmp)
        count = build(photos(args.images, work / "generated"), args.copies, work / "tree")
        shards = work / "shards"
        convert(work / "tree", shards, ConvertOptions(maxcount=100, seed=0))
        print(
            f"{count} train and {count} val photos; {os.cpu_count()} CPUs; --model {args.model}, "
            f"--num-workers {args.workers}, --loader-workers {args.loader_workers}"
        )
        results: dict[str, list[tuple[float, list[float], list[float]]]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                results[mode].append(run(shards, mode, args, work))
                seconds, rates, validations = results[mode][-1]
                said = f"; validations {', '.join(f'{v:.1f}' for v in validations)} s" if validations else ""
                print(f"  {mode:8s} {seconds:.1f} s; epochs' images/s {', '.join(f'{r:.1f}' for r in rates)}{said}")
        wall = {mode: statistics.median(r[0] for r in runs) for mode, runs in results.items()}
        rate = {mode: statistics.median(x for r in runs for x in r[1]) for mode, runs in results.items()}
        print("\n| validation | whole run, s (median) | training images/s (median epoch) |\n|---|---|---|")
        for mode in MODES:
            print(f"| {mode} | {wall[mode]:.1f} | {rate[mode]:.1f} |")
        saved = wall["in-loop"] - wall["apart"]
        print(f"apart / in-loop, whole run: {wall['apart'] / wall['in-loop']:.2f}x ({saved:+.1f} s saved)")


if __name__ == "__main__":
    main()
