"""The `raywds` command: its flags, and the one place where a RaywdsError becomes exit code 1
and a one-line message. What each command does is in raywds.commands; the training flags are
made from TrainConfig (raywds.flags).

    raywds --help
    raywds train --demo
    python -m raywds train --demo            # the same; torchrun -m raywds train ... runs DDP ranks
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from raywds import console
from raywds.commands import COMMANDS, DEMO_DIR
from raywds.config import RECIPES
from raywds.errors import RaywdsError, one_line
from raywds.flags import add_config_flags

BACKENDS = ("auto", "docker", "nginx", "embedded")
PLAN_FIELDS = (
    "mode",
    "canonical_nodes",
    "num_loader_workers_per_rank",
    "batch_size_per_rank",
    "batches_per_epoch",
    "seed",
    "shuffle_buffer_samples",
    "cross_worker_shuffle_samples",
)
"""The config fields `raywds plan` takes, with the config's defaults."""


def _add_train_flags(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--data", help="shard directory, manifest.json, or http(s) URL of a shard server")
    source.add_argument(
        "--demo", action="store_true", help="generate, convert and serve the demo data, then train on it"
    )
    p.add_argument("--recipe", choices=list(RECIPES), help="preset values (flags and --config override them)")
    p.add_argument("--config", help="a .json or .toml file of config fields (overrides the recipe; flags override it)")
    add_config_flags(p, skip=skip)
    p.add_argument(
        "--demo-dir", default=DEMO_DIR, help=f"where --demo keeps its images and shards (default {DEMO_DIR})"
    )
    p.add_argument("--server-backend", default="auto", choices=BACKENDS, help="shard server for --demo and --serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raywds", description="Train image classifiers from WebDataset shards, on one machine or a Ray cluster."
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the full traceback of an error, not just its one line"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="write the generated demo ImageNet-layout tree")
    p.add_argument("--out", default=f"{DEMO_DIR}/images", help="output folder (default %(default)s)")

    p = sub.add_parser("convert", help="ImageNet tree or ImageFolder -> WebDataset shards + manifest.json")
    p.add_argument("src", help="folder holding train/<class>/* and val/<class>/*, or one ImageFolder")
    p.add_argument("out", help="output folder for the shards, or s3://BUCKET/PREFIX")
    p.add_argument("--maxcount", type=int, default=1000, help="most samples per shard (default %(default)s)")
    p.add_argument("--maxsize", type=int, default=1 << 30, help="most bytes per shard (default %(default)s)")
    p.add_argument("--workers", type=int, default=1, help="processes writing shards (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sample shuffle seed (default %(default)s)")
    p.add_argument("--prefix", default="imagenet", help="shard name prefix (default %(default)s)")
    p.add_argument(
        "--max-side",
        type=int,
        dest="max_side_px",
        help="downscale images whose longer side exceeds this many pixels (re-encodes them)",
    )
    p.add_argument("--strict", action="store_true", help="stop at the first unreadable image instead of skipping it")
    p.add_argument("--overwrite", action="store_true", help="replace shards in OUT made with other settings")
    p.add_argument("--staging", help="with an s3:// OUT: the local folder to convert into first (default: in /tmp)")
    p.add_argument("--s3-endpoint", help="with an s3:// OUT: the store's URL (default AWS_ENDPOINT_URL, else AWS)")
    p.add_argument(
        "--val-labels",
        type=Path,
        help="labels for a flat val/: LOC_val_solution.csv or ILSVRC2012_validation_ground_truth.txt",
    )
    p.add_argument(
        "--val-wnids",
        type=Path,
        help="for the devkit ground truth: meta.mat, or a text file of wnids in ILSVRC2012_ID order",
    )

    p = sub.add_parser("verify", help="re-read every shard and check it against manifest.json")
    p.add_argument("shards", help="shard folder (with manifest.json), or s3://BUCKET/PREFIX")
    p.add_argument("--s3-endpoint", help="with s3:// shards: the store's URL (default AWS_ENDPOINT_URL, else AWS)")

    p = sub.add_parser("audit", help="check a run's --audit-dir: every sample trained on once per epoch")
    p.add_argument("audit_dir", type=Path, help="the run's --audit-dir")
    p.add_argument("--data", required=True, help="the run's --data (its manifest numbers the samples)")
    p.add_argument("--epochs", type=int, help="check the first N epochs (default: every epoch the files hold)")
    p.add_argument("--s3-endpoint", help="with s3:// data: the store's URL (default AWS_ENDPOINT_URL, else AWS)")

    p = sub.add_parser("shardsum", help="shard names (arguments or stdin) in brace notation")
    p.add_argument("names", nargs="*", help="shard names; read from stdin when none are given")

    p = sub.add_parser(
        "serve", help="serve a shard folder over HTTP until interrupted (nginx in Docker, local nginx, or embedded)"
    )
    p.add_argument("shards", nargs="?", help="shard folder (with manifest.json)")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to listen on (default %(default)s: every interface, for multi-node jobs)",
    )
    p.add_argument("--local", action="store_true", help="listen on 127.0.0.1 only (single-node jobs)")
    p.add_argument("--port", type=int, default=8080, help="port (default %(default)s; 0 picks a free one)")
    p.add_argument(
        "--advertise", help="host name or IP workers should use (default: this node's IP, or 127.0.0.1 with --local)"
    )
    p.add_argument("--image", default="nginx:stable", help="Docker image with nginx (default %(default)s)")
    p.add_argument(
        "--network",
        choices=["host", "bridge"],
        default="host",
        help="Docker: host networking, or publish the port from a bridge network (default %(default)s)",
    )
    p.add_argument("--no-pull", action="store_true", help="Docker: use only a local image, never pull one")
    p.add_argument("--stop-all", action="store_true", help="remove every raywds shard-server container and exit")

    p = sub.add_parser(
        "plan", help="show what each rank and loader worker reads in an epoch, and whether the setup would hang"
    )
    p.add_argument("--data", help="shard folder, manifest.json or URL (or give --num-shards and --samples-per-shard)")
    p.add_argument("--num-shards", type=int, help="without --data: this many training shards")
    p.add_argument("--samples-per-shard", type=int, help="without --data: samples in each shard")
    p.add_argument(
        "--last-shard-samples", type=int, help="without --data: samples in the last shard (default: as the others)"
    )
    p.add_argument("--nodes", type=int, default=1, help="nodes in the job (default %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default %(default)s)")
    p.add_argument("--epoch", type=int, default=0, help="which epoch's shuffle to show (default %(default)s)")
    p.add_argument("--ranks-shown", type=int, default=16, help="rows of the per-rank table (default %(default)s)")
    p.add_argument(
        "--shuffle-report", action="store_true", help="also measure how well the loader order mixes the data"
    )
    p.add_argument(
        "--classes",
        type=int,
        default=1000,
        help="--shuffle-report without --data: classes in the data (default %(default)s)",
    )
    p.add_argument(
        "--report-batches",
        type=int,
        default=50,
        help="--shuffle-report: batches per rank to simulate (default %(default)s)",
    )
    add_config_flags(p, only=PLAN_FIELDS, with_defaults=True, aliases={"num_loader_workers_per_rank": ("--workers",)})

    p = sub.add_parser("report", help="plot a run's loss, accuracy, throughput and data wait to a PNG")
    p.add_argument(
        "run_dir", help="the --out folder of a local run, or a Ray run's folder or s3://… prefix (with metrics.jsonl)"
    )
    p.add_argument("--out", help="PNG path (default RUN_DIR/report.png; NAME-report.png here for an s3:// run)")
    p.add_argument("--s3-endpoint", help="the S3 store's URL, for an s3:// run (default AWS_ENDPOINT_URL, else AWS)")

    p = sub.add_parser("doctor", help="why a run's GPUs waited: the bottleneck, the rank and node, and what to change")
    p.add_argument("run_dir", help="a run's folder or s3://… prefix (with metrics.jsonl), as for `raywds report`")
    p.add_argument("--epoch", type=int, help="the epoch to look at, from 1 (default: the last)")
    p.add_argument("--s3-endpoint", help="the S3 store's URL, for an s3:// run (default AWS_ENDPOINT_URL, else AWS)")

    p = sub.add_parser("train", help="train in this process (or one torchrun rank), no Ray")
    _add_train_flags(p)

    p = sub.add_parser("ray", help="train with a Ray Train TorchTrainer on the cluster (one worker per GPU)")
    _add_train_flags(p, skip=("out_dir",))  # a Ray run's folder is under --storage-path
    p.add_argument(
        "--serve",
        action="store_true",
        help="serve the --data folder from this driver, so workers on every node read it over HTTP",
    )
    p.add_argument(
        "--num-workers",
        type=worker_count,
        metavar="N|MIN..MAX",
        help="Ray Train workers (default: one per cluster GPU, else 2 CPU workers); MIN..MAX is elastic: "
        "start with what the cluster holds, shrink when a node is lost, grow when nodes come",
    )
    p.add_argument(
        "--address", help="Ray cluster address (default: RAY_ADDRESS, a running `ray start`, else a new local cluster)"
    )
    p.add_argument(
        "--storage-path", default="runs/ray", help="Ray Train storage for checkpoints and results (default %(default)s)"
    )
    p.add_argument(
        "--max-failures",
        type=int,
        default=3,
        help="restarts after a worker or its node is lost, each resuming from the latest checkpoint; "
        "as many waits for a fixed worker count to fit again (default %(default)s)",
    )
    p.add_argument(
        "--node-wait-s",
        type=float,
        help="after a failure, how long Ray waits for the workers to fit on the cluster before that "
        "restart counts as failed too (default: Ray's, 60)",
    )
    p.add_argument(
        "--resize-check-s",
        type=float,
        default=60.0,
        help="elastic runs: how often Ray checks whether more workers fit (default %(default)s)",
    )
    p.add_argument(
        "--keep-checkpoints", type=int, default=2, help="checkpoints kept in the run folder (default %(default)s)"
    )
    p.add_argument(
        "--data-plane",
        default="loader",
        choices=["loader", "ray"],
        help="who reads and decodes the shards: each rank's own DataLoader workers (loader), or Ray Data tasks "
        "on any node of the cluster (ray; --loader-workers then has no effect) (default %(default)s)",
    )
    p.add_argument(
        "--plane-store-mb",
        type=int,
        default=1024,
        help="--data-plane ray: object store memory each rank's pipeline may fill with blocks (default %(default)s)",
    )
    p.add_argument(
        "--worker-resource",
        type=resource,
        action="append",
        metavar="NAME=AMOUNT",
        help="a custom Ray resource each training worker reserves, so the workers run only on nodes that have it "
        "(`ray start --resources '{\"trainer\": 8}'`); repeatable",
    )
    p.add_argument("--name", help="Ray Train run name (default raywds-DATE-TIME; reusing a name resumes that run)")
    return parser


def resource(text: str) -> tuple[str, float]:
    """`--worker-resource`: NAME=AMOUNT."""
    name, _, amount = text.partition("=")
    try:
        if not name or float(amount) <= 0:
            raise ValueError
        return name, float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=AMOUNT with AMOUNT above 0") from None


def worker_count(text: str) -> int | tuple[int, int]:
    """`--num-workers`: N, or MIN..MAX for an elastic run."""
    try:
        if ".." in text:
            low, high = (int(part) for part in text.split("..", 1))
            return (low, high)
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither N nor MIN..MAX") from None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # SystemExit unwinds the `with` blocks, so a shard server started here is stopped too.
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    console.configure()
    try:
        COMMANDS[args.command](args)
    except RaywdsError as e:
        if args.debug:
            traceback.print_exc()
        lines = one_line(e).splitlines() or [""]
        print(f"raywds: error: {lines[0]}", file=sys.stderr)
        if lines[1:]:
            print("\n".join(lines[1:]), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
