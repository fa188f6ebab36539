"""What each `raywds` command does with its options: each command takes the typed objects that
raywds.cli makes once from its parsed flags, one per group of them (raywds.cli.options.COMMAND_FLAGS).
Imports are inside each command: `raywds convert` never loads torch, `raywds plan` never loads Ray.

    cmd_verify(VerifyOptions(shards="shards/"))
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from raywds.cli.options import (
    AuditOptions,
    ConvertWhere,
    DemoOptions,
    DoctorOptions,
    EvaluateOptions,
    ExportOptions,
    IndexWhere,
    PlanOptions,
    PredictOptions,
    ReportOptions,
    ServeOptions,
    ShardsumOptions,
    Source,
    Training,
    VerifyOptions,
)
from raywds.data.shardoptions import ConvertOptions, IndexOptions
from raywds.errors import ConfigError, RaywdsError
from raywds.launch.rayoptions import RayOptions
from raywds.plan.modes import Schedule


@contextlib.contextmanager
def _served(root: Any, source: Source, host: str, advertise: str | None) -> Iterator[str]:
    from raywds.serve import ShardServer

    with ShardServer(root, backend=source.server_backend, host=host, advertise=advertise) as server:  # over HTTP
        for line in server.skipped:
            print(f"raywds: skipped {line}", flush=True)
        shown = server.root if not source.demo else root
        print(f"raywds: serving {shown} at {server.url} ({server.backend})", flush=True)
        yield server.url


@contextlib.contextmanager
def _data(source: Source, serve: bool = False, host: str = "127.0.0.1", advertise: str | None = None) -> Iterator[str]:
    """The --data location (served over HTTP with `serve`), or for --demo the URL of a server
    over freshly made demo shards."""
    if not source.demo:
        if not source.data:
            raise RaywdsError("no data: give --data SHARDS_DIR_OR_URL, or --demo to train on generated demo data")
        if not serve:
            yield source.data
            return
        with _served(source.data, source, host, advertise) as url:
            yield url
        return
    from raywds.data.demo import prepare

    start = time.perf_counter()
    shards = prepare(Path(source.demo_dir))
    print(f"raywds: demo shards ready in {shards} ({time.perf_counter() - start:.1f} s)", flush=True)
    with _served(shards, source, host, advertise) as url:
        yield url


def cmd_demo(options: DemoOptions) -> None:
    from raywds.data.demo import write_tree

    out = write_tree(Path(options.out))
    print(f"raywds: demo tree written to {out}")


def cmd_convert(where: ConvertWhere, options: ConvertOptions) -> None:
    from raywds.data import stores
    from raywds.data.append import append, appended_lines
    from raywds.data.convert import convert, summary
    from raywds.data.listed import tree_at
    from raywds.data.manifest import shard_url
    from raywds.data.upload import check_places, convert_to_bucket

    check_places(where.src, where.out)
    staging = Path(where.staging) if where.staging else None
    if where.ray:
        from raywds.launch.ray_convert import convert_on_ray

        manifest = convert_on_ray(
            where.src,
            where.out,
            options,
            where.address,
            append=where.append,
            storage=where.storage,
            staging=staging,
        )
    elif stores.is_url(where.out):
        if where.append:
            raise ConfigError(f"--append adds to a dataset in a folder, not in a bucket ({where.out}) yet")
        tree = tree_at(where.src, where.storage)
        manifest = convert_to_bucket(tree, where.out, options, staging=staging, storage=where.storage)
    else:
        tree = tree_at(where.src, where.storage)
        manifest = (append if where.append else convert)(tree, Path(where.out), options)
    lines = summary(manifest, shard_url(where.out, "manifest.json"))
    print("\n".join([*lines[:-1], *(appended_lines(manifest) if where.append else []), lines[-1]]))


def cmd_verify(options: VerifyOptions) -> None:
    from raywds.data.verify import verify

    count, problems = verify(options.shards, options.storage)
    if problems:
        raise RaywdsError(f"{len(problems)} problems in {count} shards of {options.shards}:\n" + "\n".join(problems))
    print(f"raywds: {count} shards in {options.shards} match the manifest")


def cmd_index(where: IndexWhere, options: IndexOptions) -> None:
    from tqdm import tqdm

    from raywds.data.dataset import summary, write_index
    from raywds.data.index import index_shards
    from raywds.data.shardlists import splits_of

    splits = splits_of(where.shards, where.train, where.val, where.storage)
    total = sum(len(v) for v in splits.values())
    with tqdm(total=total, unit="shard", desc="raywds: indexing", file=sys.stderr, disable=None) as bar:
        manifest = index_shards(splits, options, policy=where.storage.read_policy(), progress=bar.update)
    print("\n".join(summary(manifest, write_index(manifest, where.out, where.storage))))


def cmd_audit(options: AuditOptions) -> None:
    from raywds.data.dataset import manifest_for
    from raywds.train.audit import audit

    manifest = manifest_for(options.data, storage=options.storage, index_cache=options.index_cache)
    checks = audit(options.audit_dir, manifest, options.epochs)
    print("\n".join(c.line for c in checks))
    failed = [str(c.epoch) for c in checks if c.first_problem]
    if failed:
        raise RaywdsError(f"epochs {', '.join(failed)} of {len(checks)} did not train every sample exactly once")
    print(f"raywds: {len(checks)} epochs in {options.audit_dir}: every sample exactly once in each")


def cmd_shardsum(options: ShardsumOptions) -> None:
    from raywds.data.manifest import shardsum

    names = options.names or sys.stdin.read().split()
    print("\n".join(shardsum(names)))


def cmd_serve(options: ServeOptions) -> None:
    from raywds.data.manifest import read_manifest, shardsum
    from raywds.serve import ShardServer, stop_all

    if options.stop_all:
        print(f"raywds: removed {stop_all()} shard-server container(s)")
        return
    shards = options.shards
    if not shards:
        raise RaywdsError("serve needs a shard folder (or --stop-all)")
    if options.local:  # loopback only, whatever --host says
        options = dataclasses.replace(options, host="127.0.0.1")
    with ShardServer(shards, options) as server:
        for line in server.skipped:
            print(f"raywds: skipped {line}", flush=True)
        manifest = read_manifest(str(server.root))
        print(
            (
                f"raywds: serving {server.root} at {server.url} ({server.backend}, "
                f"listening on {server.host}:{server.port}); Ctrl-C stops"
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


def cmd_plan(options: PlanOptions, training: Schedule) -> None:
    from raywds.plan.checks import check, refusals
    from raywds.plan.modes import nodes_of, parse
    from raywds.plan.render import plan_shards, render

    if training.loader_workers == "auto":  # training chooses it at each epoch's start
        raise RaywdsError("raywds plan needs a number of loader workers: --workers N")
    shards = plan_shards(options.data, options.num_shards, options.samples_per_shard, options.last_shard_samples)
    plan = parse(training.mode).plan(
        shards,
        num_ranks=options.nodes * options.gpus_per_node,
        num_workers=max(1, training.loader_workers),
        batch_size=training.batch_size,
        seed=training.seed,
        epoch=options.epoch,
        batches_per_epoch=training.batches_per_epoch,
        nodes=nodes_of(training.canonical_nodes, options.gpus_per_node),
    )
    findings = check(plan, num_shards=len(shards))
    print(render(plan, findings, gpus_per_node=options.gpus_per_node, max_ranks_shown=options.ranks_shown))
    if options.shuffle_report:
        from raywds.loader.mixing import report

        print(
            report(
                plan,
                shards,
                data=options.data,
                num_classes=options.classes,
                seed=training.seed,
                epoch=options.epoch,
                num_batches=options.report_batches,
                worker_buffer=training.worker_shuffle_buffer,
                cross_buffer=training.cross_worker_shuffle_buffer,
            )
        )
    refused = refusals(findings)
    if refused:
        raise RaywdsError(refused[0])


def cmd_report(options: ReportOptions) -> None:
    from raywds.runs.report import local_copy, plot, read_epochs

    with local_copy(options.run_dir, options.s3_endpoint) as run_dir:
        default = None if run_dir == Path(options.run_dir) else Path(f"{run_dir.name}-report.png")  # a bucket's: here
        out = plot(run_dir, Path(options.out) if options.out else default)
        last = read_epochs(run_dir)[-1]
    print(f"raywds: wrote {out} ({last['epoch']} epochs)")


def cmd_doctor(options: DoctorOptions) -> None:
    from raywds.runs.report import local_copy, read_epochs
    from raywds.train.doctor import diagnose

    with local_copy(options.run_dir, options.s3_endpoint) as run_dir:
        rows = read_epochs(run_dir)
    print("\n".join(diagnose(rows[-1] if options.epoch is None else rows[options.epoch - 1])))


def _preprocessed(cfg: Any) -> Any:
    """The config with the starting weights' mean, std and crop ratio where the flags set none,
    before any rank starts: every rank, and the Ray Data plane's driver, use the same."""
    from raywds.models.start import weights_preprocessing, with_preprocessing

    return with_preprocessing(cfg, weights_preprocessing(cfg, resume=cfg.resume, storage=cfg.storage))


def cmd_train(source: Source, training: Training) -> None:
    from raywds.launch.local import run_local
    from raywds.train.progress import summary

    with _data(source) as data:
        cfg = _preprocessed(source.config_for(data, training))
        start = time.perf_counter()
        metrics, run_dir = run_local(cfg)
    if run_dir is not None:
        print(
            f"raywds: checkpoint {run_dir.checkpoint_path}  metrics {run_dir.metrics_path}  "
            f"({time.perf_counter() - start:.0f} s)"
        )
        print(summary(metrics))


def cmd_ray(source: Source, training: Training, ray: RayOptions) -> None:
    from raywds.launch import ray_train
    from raywds.train.progress import summary

    ray_train.connect(ray.address)
    # A single-node cluster reads the demo server over loopback; a multi-node one listens on
    # every interface and hands workers the head's IP as Ray sees it.
    multi_node = ray_train.node_count() > 1
    host, advertise = ("0.0.0.0", ray_train.node_ip()) if multi_node else ("127.0.0.1", None)
    with _data(source, serve=ray.serve, host=host, advertise=advertise) as data:
        cfg = _preprocessed(source.config_for(data, training))
        start = time.perf_counter()
        run = ray_train.run(cfg, ray)
    print(
        f"raywds: {run.plan.describe()}  checkpoint {run.checkpoint}  results {run.path}  "
        f"({time.perf_counter() - start:.0f} s)"
    )
    print(summary(run.metrics))


def cmd_evaluate(options: EvaluateOptions, reading: Training) -> None:
    from raywds.infer.evaluation import Scored, reading_config
    from raywds.infer.scorecard import FILES, check_out, default_out, summary_line, write
    from raywds.models.trained import load_trained

    out = Path(options.out) if options.out else default_out(options.model, options.split)
    check_out(out)
    trained = load_trained(options.model)
    cfg = reading_config(trained, options.data, reading.given)
    scored: Scored | None
    if options.ray:
        from raywds.launch.ray_evaluation import evaluate_on_ray

        scored = evaluate_on_ray(
            trained, cfg, split=options.split, ema=options.ema, address=options.address, num_workers=options.num_workers
        )
    else:
        from raywds.launch.evaluation import evaluate_local

        scored = evaluate_local(trained, cfg, split=options.split, ema=options.ema)
    if scored is None:  # a torchrun rank but the first: rank 0 writes and says
        return
    write(scored, model=options.model, out=out)
    ranks = len(scored.per_rank)
    print(
        f"raywds: scored {scored.model_source} on the {sum(scored.per_rank)} {options.split} samples of "
        f"{options.data} ({ranks} rank{'s' if ranks > 1 else ''}); wrote {out}: {', '.join(FILES)}  "
        f"({scored.seconds:.0f} s)"
    )
    print(summary_line(scored))


def cmd_export(options: ExportOptions) -> None:
    from raywds.models.export import export_model
    from raywds.models.onnxfile import CheckImages

    check = CheckImages(options.data, options.s3_endpoint, options.check_images) if options.onnx else None
    exported = export_model(options.model, Path(options.out), ema=options.ema, force=options.force, onnx=check)
    print("\n".join(exported.lines()))


def cmd_predict(options: PredictOptions, reading: Training) -> None:
    from raywds.infer.prediction import Tally, summary
    from raywds.infer.predictoptions import Prediction
    from raywds.launch.prediction import predict_here

    job = Prediction.of(options)
    done: tuple[Tally, float] | None
    if options.ray:
        from raywds.launch.ray_prediction import predict_on_ray

        done = predict_on_ray(job, reading.given, options.data_plane, options.address, options.num_workers)
    else:
        done = predict_here(job, reading.given)
    if done is not None:  # a torchrun rank but the first: rank 0 says
        print(f"raywds: {summary(*done, options.out)}")


COMMANDS: dict[str, Callable[..., None]] = {
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
    "evaluate": cmd_evaluate,
    "export": cmd_export,
    "predict": cmd_predict,
}
"""Each command, taking the objects raywds.cli.main.command_options makes of its flags."""
