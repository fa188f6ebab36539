"""The `raywds` command. Library code raises RaywdsError; only here does it become exit code 1
and a one-line message.

    raywds --help
    raywds train --demo
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raywds import console
from raywds.errors import RaywdsError, one_line

DEMO_DIR = "runs/demo"


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--data", help="shard directory, manifest.json, or http(s) URL of a shard server")
    source.add_argument("--demo", action="store_true", help="generate, convert and serve the demo data, then train on it")
    p.add_argument("--shards-at", help="where the shards are, if not beside the manifest: folder, base URL, or a template with {}, e.g. 'pipe:aws s3 cp s3://bucket/shards/{} -'")
    p.add_argument("--recipe", choices=["imagenet-resnet50", "imagenet-resnet18", "demo"], help="preset values (flags and --config override them)")
    p.add_argument("--config", help="a .json or .toml file of config fields (overrides the recipe; flags override it)")
    p.add_argument("--epochs", type=int, dest="num_epochs", help="passes over the training split")
    p.add_argument("--batch-size", type=int, dest="batch_size_per_rank", help="samples per batch on each rank")
    p.add_argument("--model", help="`demo` (small CPU CNN) or any torchvision model name, e.g. resnet50")
    p.add_argument("--mode", choices=["resample", "split"], help="resample (default): equal batches per rank; split: exact epochs")
    p.add_argument("--optimizer", choices=["sgd", "adamw"])
    p.add_argument("--lr", type=float, help="peak learning rate (default: 0.1 x global batch / 256 for sgd)")
    p.add_argument("--weight-decay", type=float, help="weight decay on weights (never on norms and biases)")
    p.add_argument("--warmup-epochs", type=float, help="linear warm-up before the cosine decay")
    p.add_argument("--label-smoothing", type=float, help="label smoothing of the training loss")
    p.add_argument("--image-size", type=int, dest="image_size_px", help="crop side in pixels")
    p.add_argument("--crop-scale-min", type=float, help="smallest area fraction of the random-resized crop")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], help="auto: bf16 autocast on CUDA, float32 on CPU")
    p.add_argument("--memory-format", choices=["auto", "channels_last", "contiguous"], help="auto: channels_last on CUDA")
    p.add_argument("--compile", action="store_const", const=True, help="wrap the model in torch.compile")
    p.add_argument("--decode", choices=["cpu", "device", "pil"], help="where training JPEGs are decoded: cpu (default; loader workers), device (the GPU, nvJPEG), pil (torchvision's reference transform)")
    p.add_argument("--val-every", type=int, dest="val_every_epochs", help="validate every N epochs (and after the last)")
    p.add_argument("--log-every", type=float, dest="log_every_s", help="seconds between progress lines inside an epoch (default 60)")
    p.add_argument("--loader-workers", type=int, dest="num_loader_workers_per_rank", help="DataLoader workers per rank")
    p.add_argument("--seed", type=int)
    p.add_argument("--shuffle-buffer", type=int, dest="cross_worker_shuffle_samples", help="main-process buffer that shuffles samples across loader workers (default 0: off)")
    p.add_argument("--worker-shuffle-buffer", type=int, dest="shuffle_buffer_samples", help="samples in each loader worker's shuffle buffer (default 1000)")
    p.add_argument("--batches-per-epoch", type=int, help="resample mode: batches per epoch on every rank (default ceil(N / (ranks x batch)))")
    p.add_argument("--checkpoint-every-steps", type=int, help="also checkpoint inside epochs, every this many steps")
    p.add_argument("--max-steps", type=int, help="stop after this many steps, with a checkpoint (continue later with --resume)")
    p.add_argument("--resume", dest="resume_from", help="checkpoint file or folder to continue from: weights, optimizer, data position")
    p.add_argument("--audit-dir", help="write the key of every trained sample, per epoch and rank, into files here")
    p.add_argument("--pg-timeout", type=int, dest="pg_timeout_s", help="seconds before a stalled collective is an error (default 300)")
    p.add_argument("--read-timeout", type=float, dest="read_timeout_s", help="seconds to wait for a shard's next bytes before retrying (default 60)")
    p.add_argument("--read-retries", type=int, help="retries of a failed shard read, resuming where it stopped (default 3)")
    p.add_argument("--cache-dir", help="keep http shards on local disk after their first read")
    p.add_argument("--verify-hashes", action="store_const", const=True, help="check each shard's sha256 against the manifest while reading it (catches flipped bits no decoder sees)")
    p.add_argument("--max-bad-samples", type=float, help="resample mode: undecodable samples skipped per epoch before the run stops; below 1 a fraction of the epoch (default 0.001)")
    p.add_argument("--demo-dir", default=DEMO_DIR, help=f"where --demo keeps its images and shards (default {DEMO_DIR})")
    p.add_argument("--server-backend", default="auto", choices=["auto", "docker", "nginx", "embedded"], help="shard server for --demo and --serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raywds", description="Train image classifiers from WebDataset shards, on one machine or a Ray cluster."
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error, not just its one line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="write the generated demo ImageNet-layout tree")
    p.add_argument("--out", default=f"{DEMO_DIR}/images", help="output folder (default %(default)s)")

    p = sub.add_parser("convert", help="ImageNet tree or ImageFolder -> WebDataset shards + manifest.json")
    p.add_argument("src", help="folder holding train/<class>/* and val/<class>/*, or one ImageFolder")
    p.add_argument("out", help="output folder for the shards")
    p.add_argument("--maxcount", type=int, default=1000, help="most samples per shard (default %(default)s)")
    p.add_argument("--maxsize", type=int, default=1 << 30, help="most bytes per shard (default %(default)s)")
    p.add_argument("--workers", type=int, default=1, help="processes writing shards (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sample shuffle seed (default %(default)s)")
    p.add_argument("--prefix", default="imagenet", help="shard name prefix (default %(default)s)")
    p.add_argument("--max-side", type=int, dest="max_side_px", help="downscale images whose longer side exceeds this many pixels (re-encodes them)")
    p.add_argument("--strict", action="store_true", help="stop at the first unreadable image instead of skipping it")
    p.add_argument("--overwrite", action="store_true", help="replace shards in OUT made with other settings")
    p.add_argument("--val-labels", type=Path, help="labels for a flat val/: LOC_val_solution.csv or ILSVRC2012_validation_ground_truth.txt")
    p.add_argument("--val-wnids", type=Path, help="for the devkit ground truth: meta.mat, or a text file of wnids in ILSVRC2012_ID order")

    p = sub.add_parser("verify", help="re-read every shard and check it against manifest.json")
    p.add_argument("shards", help="shard folder (with manifest.json)")

    p = sub.add_parser("shardsum", help="shard names (arguments or stdin) in brace notation")
    p.add_argument("names", nargs="*", help="shard names; read from stdin when none are given")

    p = sub.add_parser("serve", help="serve a shard folder over HTTP until interrupted (nginx in Docker, local nginx, or embedded)")
    p.add_argument("shards", nargs="?", help="shard folder (with manifest.json)")
    p.add_argument("--backend", default="auto", choices=["auto", "docker", "nginx", "embedded"])
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default %(default)s: every interface, for multi-node jobs)")
    p.add_argument("--local", action="store_true", help="listen on 127.0.0.1 only (single-node jobs)")
    p.add_argument("--port", type=int, default=8080, help="port (default %(default)s; 0 picks a free one)")
    p.add_argument("--advertise", help="host name or IP workers should use (default: this node's IP, or 127.0.0.1 with --local)")
    p.add_argument("--image", default="nginx:stable", help="Docker image with nginx (default %(default)s)")
    p.add_argument("--network", choices=["host", "bridge"], default="host", help="Docker: host networking, or publish the port from a bridge network (default %(default)s)")
    p.add_argument("--no-pull", action="store_true", help="Docker: use only a local image, never pull one")
    p.add_argument("--stop-all", action="store_true", help="remove every raywds shard-server container and exit")

    p = sub.add_parser("plan", help="show what each rank and loader worker reads in an epoch, and whether the setup would hang")
    p.add_argument("--data", help="shard folder, manifest.json or URL (or give --num-shards and --samples-per-shard)")
    p.add_argument("--num-shards", type=int, help="without --data: this many training shards")
    p.add_argument("--samples-per-shard", type=int, help="without --data: samples in each shard")
    p.add_argument("--last-shard-samples", type=int, help="without --data: samples in the last shard (default: as the others)")
    p.add_argument("--nodes", type=int, default=1, help="nodes in the job (default %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default %(default)s)")
    p.add_argument("--loader-workers", "--workers", type=int, default=2, help="DataLoader workers per rank (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="batch per rank (default %(default)s)")
    p.add_argument("--mode", choices=["resample", "split"], default="resample")
    p.add_argument("--batches-per-epoch", type=int, help="resample mode: batches per epoch per rank")
    p.add_argument("--epoch", type=int, default=0, help="which epoch's shuffle to show (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks-shown", type=int, default=16, help="rows of the per-rank table (default %(default)s)")
    p.add_argument("--shuffle-report", action="store_true", help="also measure how well the loader order mixes the data")
    p.add_argument("--classes", type=int, default=1000, help="--shuffle-report without --data: classes in the data (default %(default)s)")
    p.add_argument("--shuffle-buffer", type=int, default=0, help="--shuffle-report: main-process buffer across workers (default %(default)s)")
    p.add_argument("--worker-shuffle-buffer", type=int, default=1000, help="--shuffle-report: each worker's buffer (default %(default)s)")
    p.add_argument("--report-batches", type=int, default=50, help="--shuffle-report: batches per rank to simulate (default %(default)s)")

    p = sub.add_parser("report", help="plot a run's loss, accuracy, throughput and data wait to a PNG")
    p.add_argument("run_dir", help="the --out folder of a local run, or a Ray run folder (with metrics.jsonl)")
    p.add_argument("--out", help="PNG path (default RUN_DIR/report.png)")

    p = sub.add_parser("train", help="train in this process (or one torchrun rank), no Ray")
    _add_train_flags(p)
    p.add_argument("--out", dest="out_dir", help="checkpoint and metrics folder (default runs/local, runs/demo for --demo)")

    p = sub.add_parser("ray", help="train with a Ray Train TorchTrainer on the cluster (one worker per GPU)")
    _add_train_flags(p)
    p.add_argument("--serve", action="store_true", help="serve the --data folder from this driver, so workers on every node read it over HTTP")
    p.add_argument("--num-workers", type=int, help="Ray Train workers (default: one per cluster GPU, else 2 CPU workers)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, a running `ray start`, else a new local cluster)")
    p.add_argument("--storage-path", default="runs/ray", help="Ray Train storage for checkpoints and results (default %(default)s)")
    p.add_argument("--max-failures", type=int, default=0, help="restarts after a worker dies, each resuming from the latest checkpoint (default %(default)s)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints kept in the run folder (default %(default)s)")
    p.add_argument("--name", help="Ray Train run name (default raywds-DATE-TIME; reusing a name resumes that run)")
    return parser


TRAIN_FIELDS = [
    "shards_at", "num_epochs", "batch_size_per_rank", "model", "mode", "optimizer", "lr", "weight_decay", "warmup_epochs",
    "label_smoothing", "image_size_px", "crop_scale_min", "precision", "memory_format", "compile", "decode", "val_every_epochs",
    "num_loader_workers_per_rank", "seed", "out_dir", "log_every_s", "cross_worker_shuffle_samples", "shuffle_buffer_samples",
    "batches_per_epoch", "checkpoint_every_steps", "max_steps", "resume_from", "audit_dir", "pg_timeout_s",
    "read_timeout_s", "read_retries", "cache_dir", "verify_hashes", "max_bad_samples",
]  # fmt: skip


def _config(args: argparse.Namespace, data: str) -> Any:
    """Recipe (`demo` for --demo), then --config, then the flags given."""
    from raywds.config import resolve

    recipe = args.recipe or ("demo" if args.demo else None)
    given = {n: getattr(args, n, None) for n in TRAIN_FIELDS}
    return resolve(data, recipe=recipe, config_file=args.config, **given)


@contextlib.contextmanager
def _data(args: argparse.Namespace, host: str = "127.0.0.1") -> Iterator[str]:
    """The --data location, or for --demo the URL of a server over freshly made demo shards."""
    if not args.demo:
        if not args.data:
            raise RaywdsError("no data: give --data SHARDS_DIR_OR_URL, or --demo to train on generated demo data")
        if not getattr(args, "serve", False):
            yield args.data
            return
        from raywds.server import ShardServer

        with ShardServer(args.data, backend=args.server_backend, host=host) as server:  # workers read it over HTTP
            for line in server.skipped:
                print(f"raywds: skipped {line}", flush=True)
            print(f"raywds: serving {server.root} at {server.url} ({server.backend})", flush=True)
            yield server.url
        return
    from raywds.demo import prepare
    from raywds.server import ShardServer

    start = time.perf_counter()
    shards = prepare(Path(args.demo_dir))
    print(f"raywds: demo shards ready in {shards} ({time.perf_counter() - start:.1f} s)", flush=True)
    with ShardServer(shards, backend=args.server_backend, host=host) as server:
        for line in server.skipped:
            print(f"raywds: skipped {line}", flush=True)
        print(f"raywds: serving {shards} at {server.url} ({server.backend})", flush=True)
        yield server.url


def cmd_demo(args: argparse.Namespace) -> None:
    from raywds.demo import write_tree

    out = write_tree(Path(args.out))
    print(f"raywds: demo tree written to {out}")


def cmd_convert(args: argparse.Namespace) -> None:
    from raywds.convert import ConvertOptions, convert

    options = ConvertOptions(
        maxcount=args.maxcount, maxsize=args.maxsize, num_workers=args.workers, seed=args.seed, prefix=args.prefix,
        strict=args.strict, overwrite=args.overwrite, val_labels=args.val_labels, val_wnids=args.val_wnids, max_side_px=args.max_side_px,
    )  # fmt: skip
    manifest = convert(Path(args.src), Path(args.out), options)
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['num_samples']} samples in {len(info['shards'])} shards ({manifest['layouts'][split]})")
    if manifest["kept_from_earlier_run"]:
        print(f"kept {manifest['kept_from_earlier_run']} finished shards from an earlier run")
    if manifest["ignored"]["count"]:
        print(f"ignored {manifest['ignored']['count']} files that are not images, e.g. {', '.join(manifest['ignored']['examples'][:3])}")
    if manifest["skipped"]:
        print(f"skipped {len(manifest['skipped'])} unreadable images (listed in the manifest):")
        for bad in manifest["skipped"][:50]:
            print(f"  {bad['path']}: {bad['reason']}")
    print(f"raywds: wrote {Path(args.out) / 'manifest.json'} ({len(manifest['classes'])} classes)")


def cmd_verify(args: argparse.Namespace) -> None:
    from raywds.verify import verify

    count, problems = verify(Path(args.shards))
    if problems:
        raise RaywdsError(f"{len(problems)} problems in {count} shards of {args.shards}:\n" + "\n".join(problems))
    print(f"raywds: {count} shards in {args.shards} match the manifest")


def cmd_shardsum(args: argparse.Namespace) -> None:
    from raywds.shards import shardsum

    names = args.names or sys.stdin.read().split()
    print("\n".join(shardsum(names)))


def cmd_serve(args: argparse.Namespace) -> None:
    from raywds.server import ShardServer, stop_all
    from raywds.shards import read_manifest, shardsum

    if args.stop_all:
        print(f"raywds: removed {stop_all()} shard-server container(s)")
        return
    if not args.shards:
        raise RaywdsError("serve needs a shard folder (or --stop-all)")
    host = "127.0.0.1" if args.local else args.host
    server = ShardServer(args.shards, backend=args.backend, host=host, port=args.port, advertise=args.advertise, image=args.image, network=args.network, pull=not args.no_pull)
    with server:
        for line in server.skipped:
            print(f"raywds: skipped {line}", flush=True)
        manifest = read_manifest(str(server.root))
        print(f"raywds: serving {server.root} at {server.url} ({server.backend}, listening on {host}:{server.port}); Ctrl-C stops", flush=True)
        for split in manifest.splits:
            for pattern in shardsum([s.name for s in manifest.shards(split)]):
                print(f"  {split}: {server.url}/{pattern}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


def cmd_plan(args: argparse.Namespace) -> None:
    from raywds import plan as planner
    from raywds.shards import ShardInfo, read_manifest

    if args.data:
        shards = read_manifest(args.data).shards("train")
    elif args.num_shards and args.samples_per_shard:
        sizes = [args.samples_per_shard] * args.num_shards
        if args.last_shard_samples is not None:
            sizes[-1] = args.last_shard_samples
        shards = [ShardInfo(f"shard-{i:06d}.tar", n, 0, "") for i, n in enumerate(sizes)]
    else:
        raise RaywdsError("plan needs --data SHARDS, or --num-shards N --samples-per-shard K")
    ranks = args.nodes * args.gpus_per_node
    workers = max(1, args.loader_workers)
    if args.mode == "split":
        plan = planner.split_plan(shards, num_ranks=ranks, num_workers=workers, batch_size=args.batch_size, seed=args.seed, epoch=args.epoch)
    else:
        plan = planner.resample_plan(
            sum(s.num_samples for s in shards), num_ranks=ranks, num_workers=workers, batch_size=args.batch_size,
            batches_per_epoch=args.batches_per_epoch,
        )  # fmt: skip
    findings = planner.check(plan, num_shards=len(shards))
    print(planner.render(plan, findings, gpus_per_node=args.gpus_per_node, max_ranks_shown=args.ranks_shown))
    if args.shuffle_report:
        from raywds.mixing import report

        print(report(plan, shards, data=args.data, num_classes=args.classes, seed=args.seed, epoch=args.epoch,
                     worker_buffer=args.worker_shuffle_buffer, cross_buffer=args.shuffle_buffer, num_batches=args.report_batches))  # fmt: skip
    refused = planner.refusals(findings)
    if refused:
        raise RaywdsError(refused[0])


def cmd_report(args: argparse.Namespace) -> None:
    from raywds.report import plot, read_epochs

    out = plot(Path(args.run_dir), Path(args.out) if args.out else None)
    last = read_epochs(Path(args.run_dir))[-1]
    print(f"raywds: wrote {out} ({last['epoch']} epochs)")


def cmd_train(args: argparse.Namespace) -> None:
    from raywds.train import run_local, summary_line

    with _data(args) as data:
        cfg = _config(args, data)
        start = time.perf_counter()
        metrics, report = run_local(cfg)
    if report is not None:
        print(f"raywds: checkpoint {report.checkpoint_path}  metrics {report.metrics_path}  ({time.perf_counter() - start:.0f} s)")
        print(summary_line(metrics))


def cmd_ray(args: argparse.Namespace) -> None:
    from raywds import ray_train
    from raywds.train import summary_line

    ray_train.connect(args.address)
    # A single-node cluster reads the demo server over loopback; a multi-node one listens on
    # every interface and hands workers the head's IP as Ray sees it.
    host = "0.0.0.0" if ray_train.node_count() > 1 else "127.0.0.1"
    with _data(args, host=host) as data:
        cfg = _config(args, data)
        start = time.perf_counter()
        run = ray_train.run(
            cfg, num_workers=args.num_workers, storage_path=args.storage_path, name=args.name,
            num_checkpoints_to_keep=args.keep_checkpoints, max_failures=args.max_failures,
        )  # fmt: skip
    print(f"raywds: {run.plan.describe()}  checkpoint {run.checkpoint}  results {run.path}  ({time.perf_counter() - start:.0f} s)")
    print(summary_line(run.metrics))


COMMANDS = {
    "demo": cmd_demo, "convert": cmd_convert, "verify": cmd_verify, "shardsum": cmd_shardsum, "serve": cmd_serve,
    "plan": cmd_plan, "report": cmd_report, "train": cmd_train, "ray": cmd_ray,
}  # fmt: skip


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
