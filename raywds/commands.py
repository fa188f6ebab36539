"""What each `raywds` command does, once its flags are parsed (raywds.cli). Imports are
inside each command: `raywds convert` never loads torch, `raywds plan` never loads Ray."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raywds.errors import RaywdsError
from raywds.flags import given, values


def _config(args: argparse.Namespace, data: str) -> Any:
    """Recipe (`demo` for --demo), then --config, then the flags given."""
    from raywds.config import resolve

    recipe = args.recipe or ("demo" if args.demo else None)
    return resolve(data, recipe=recipe, config_file=args.config, **given(args))


@contextlib.contextmanager
def _served(root: Any, args: argparse.Namespace, host: str, advertise: str | None) -> Iterator[str]:
    from raywds.serve import ShardServer

    with ShardServer(root, backend=args.server_backend, host=host, advertise=advertise) as server:  # over HTTP
        for line in server.skipped:
            print(f"raywds: skipped {line}", flush=True)
        shown = server.root if not args.demo else root
        print(f"raywds: serving {shown} at {server.url} ({server.backend})", flush=True)
        yield server.url


@contextlib.contextmanager
def _data(args: argparse.Namespace, host: str = "127.0.0.1", advertise: str | None = None) -> Iterator[str]:
    """The --data location, or for --demo the URL of a server over freshly made demo shards."""
    if not args.demo:
        if not args.data:
            raise RaywdsError("no data: give --data SHARDS_DIR_OR_URL, or --demo to train on generated demo data")
        if not getattr(args, "serve", False):
            yield args.data
            return
        with _served(args.data, args, host, advertise) as url:
            yield url
        return
    from raywds.data.demo import prepare

    start = time.perf_counter()
    shards = prepare(Path(args.demo_dir))
    print(f"raywds: demo shards ready in {shards} ({time.perf_counter() - start:.1f} s)", flush=True)
    with _served(shards, args, host, advertise) as url:
        yield url


def cmd_demo(args: argparse.Namespace) -> None:
    from raywds.data.demo import write_tree

    out = write_tree(Path(args.out))
    print(f"raywds: demo tree written to {out}")


def cmd_convert(args: argparse.Namespace) -> None:
    from raywds.data import stores
    from raywds.data.convert import ConvertOptions, convert, summary
    from raywds.data.manifest import shard_url
    from raywds.data.upload import check_places, convert_to_bucket

    options = ConvertOptions(**values(args, ConvertOptions))
    check_places(args.src, args.out)
    if stores.is_url(args.out):
        manifest = convert_to_bucket(
            Path(args.src), args.out, options, staging=args.staging and Path(args.staging), endpoint=args.s3_endpoint
        )
    else:
        manifest = convert(Path(args.src), Path(args.out), options)
    print("\n".join(summary(manifest, shard_url(args.out, "manifest.json"))))


def cmd_verify(args: argparse.Namespace) -> None:
    from raywds.data.verify import verify

    count, problems = verify(args.shards, s3_endpoint=args.s3_endpoint)
    if problems:
        raise RaywdsError(f"{len(problems)} problems in {count} shards of {args.shards}:\n" + "\n".join(problems))
    print(f"raywds: {count} shards in {args.shards} match the manifest")


def cmd_index(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from raywds.data.dataset import summary, write_index
    from raywds.data.http import ReadPolicy
    from raywds.data.index import IndexOptions, index_shards
    from raywds.data.shardlists import splits_of

    splits = splits_of(args.shards, args.train, args.val, args.s3_endpoint)
    total = sum(len(v) for v in splits.values())
    with tqdm(total=total, unit="shard", desc="raywds: indexing", file=sys.stderr, disable=None) as bar:
        policy = ReadPolicy(s3_endpoint=args.s3_endpoint)
        manifest = index_shards(splits, IndexOptions(**values(args, IndexOptions)), policy=policy, progress=bar.update)
    print("\n".join(summary(manifest, write_index(manifest, args.out, args.s3_endpoint))))


def cmd_audit(args: argparse.Namespace) -> None:
    from raywds.data.dataset import manifest_for
    from raywds.train.audit import audit

    checks = audit(
        args.audit_dir, manifest_for(args.data, s3_endpoint=args.s3_endpoint, index_cache=args.index_cache), args.epochs
    )
    print("\n".join(c.line for c in checks))
    failed = [str(c.epoch) for c in checks if c.first_problem]
    if failed:
        raise RaywdsError(f"epochs {', '.join(failed)} of {len(checks)} did not train every sample exactly once")
    print(f"raywds: {len(checks)} epochs in {args.audit_dir}: every sample exactly once in each")


def cmd_shardsum(args: argparse.Namespace) -> None:
    from raywds.data.manifest import shardsum

    names = args.names or sys.stdin.read().split()
    print("\n".join(shardsum(names)))


def cmd_serve(args: argparse.Namespace) -> None:
    from raywds.data.manifest import read_manifest, shardsum
    from raywds.serve import ShardServer, stop_all

    if args.stop_all:
        print(f"raywds: removed {stop_all()} shard-server container(s)")
        return
    if not args.shards:
        raise RaywdsError("serve needs a shard folder (or --stop-all)")
    host = "127.0.0.1" if args.local else args.host
    server = ShardServer(
        args.shards,
        backend=args.backend,
        host=host,
        port=args.port,
        advertise=args.advertise,
        image=args.image,
        network=args.network,
        pull=not args.no_pull,
    )
    with server:
        for line in server.skipped:
            print(f"raywds: skipped {line}", flush=True)
        manifest = read_manifest(str(server.root))
        print(
            (
                f"raywds: serving {server.root} at {server.url} ({server.backend}, listening on {host}:{server.port}); "
                "Ctrl-C stops"
            ),
            flush=True,
        )
        for split in manifest.splits:
            for pattern in shardsum([s.name for s in manifest.shards(split)]):
                print(f"  {split}: {server.url}/{pattern}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


def cmd_plan(args: argparse.Namespace) -> None:
    from raywds.plan.checks import check, refusals
    from raywds.plan.modes import nodes_of, parse
    from raywds.plan.render import plan_shards, render

    if args.loader_workers == "auto":  # training chooses it at each epoch's start
        raise RaywdsError("raywds plan needs a number of loader workers: --workers N")
    shards = plan_shards(args.data, args.num_shards, args.samples_per_shard, args.last_shard_samples)
    plan = parse(args.mode).plan(
        shards,
        num_ranks=args.nodes * args.gpus_per_node,
        num_workers=max(1, args.loader_workers),
        batch_size=args.batch_size,
        seed=args.seed,
        epoch=args.epoch,
        batches_per_epoch=args.batches_per_epoch,
        nodes=nodes_of(args.canonical_nodes, args.gpus_per_node),
    )
    findings = check(plan, num_shards=len(shards))
    print(render(plan, findings, gpus_per_node=args.gpus_per_node, max_ranks_shown=args.ranks_shown))
    if args.shuffle_report:
        from raywds.loader.mixing import report

        buffers = {"worker_buffer": args.worker_shuffle_buffer, "cross_buffer": args.cross_worker_shuffle_buffer}
        print(
            report(
                plan,
                shards,
                data=args.data,
                num_classes=args.classes,
                seed=args.seed,
                epoch=args.epoch,
                num_batches=args.report_batches,
                **buffers,
            )
        )
    refused = refusals(findings)
    if refused:
        raise RaywdsError(refused[0])


def cmd_report(args: argparse.Namespace) -> None:
    from raywds.runs.report import local_copy, plot, read_epochs

    with local_copy(args.run_dir, args.s3_endpoint) as run_dir:
        default = None if run_dir == Path(args.run_dir) else Path(f"{run_dir.name}-report.png")  # a bucket's: here
        out = plot(run_dir, Path(args.out) if args.out else default)
        last = read_epochs(run_dir)[-1]
    print(f"raywds: wrote {out} ({last['epoch']} epochs)")


def cmd_doctor(args: argparse.Namespace) -> None:
    from raywds.runs.report import local_copy, read_epochs
    from raywds.train.doctor import diagnose

    with local_copy(args.run_dir, args.s3_endpoint) as run_dir:
        rows = read_epochs(run_dir)
    print("\n".join(diagnose(rows[-1] if args.epoch is None else rows[args.epoch - 1])))


def cmd_train(args: argparse.Namespace) -> None:
    from raywds.launch.local import run_local
    from raywds.train.progress import summary

    with _data(args) as data:
        cfg = _config(args, data)
        start = time.perf_counter()
        metrics, run_dir = run_local(cfg)
    if run_dir is not None:
        print(
            f"raywds: checkpoint {run_dir.checkpoint_path}  metrics {run_dir.metrics_path}  "
            f"({time.perf_counter() - start:.0f} s)"
        )
        print(summary(metrics))


def cmd_ray(args: argparse.Namespace) -> None:
    from raywds.launch import ray_train
    from raywds.train.progress import summary

    ray_train.connect(args.address)
    # A single-node cluster reads the demo server over loopback; a multi-node one listens on
    # every interface and hands workers the head's IP as Ray sees it.
    multi_node = ray_train.node_count() > 1
    host, advertise = ("0.0.0.0", ray_train.node_ip()) if multi_node else ("127.0.0.1", None)
    with _data(args, host=host, advertise=advertise) as data:
        cfg = _config(args, data)
        start = time.perf_counter()
        run = ray_train.run(
            cfg,
            num_workers=args.num_workers,
            storage_path=args.storage_path,
            name=args.name,
            num_checkpoints_to_keep=args.keep_checkpoints,
            max_failures=args.max_failures,
            resize_check_s=args.resize_check_s,
            node_wait_s=args.node_wait_s,
            data_plane=args.data_plane,
            worker_resources=dict(args.worker_resource or []),
            plane_store_mb=args.plane_store_mb,
        )
    print(
        f"raywds: {run.plan.describe()}  checkpoint {run.checkpoint}  results {run.path}  "
        f"({time.perf_counter() - start:.0f} s)"
    )
    print(summary(run.metrics))


COMMANDS = {
    "demo": cmd_demo,
    "convert": cmd_convert,
    "verify": cmd_verify,
    "index": cmd_index,
    "audit": cmd_audit,
    "shardsum": cmd_shardsum,
    "serve": cmd_serve,
    "plan": cmd_plan,
    "report": cmd_report,
    "doctor": cmd_doctor,
    "train": cmd_train,
    "ray": cmd_ray,
}
