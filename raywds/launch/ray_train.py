"""Ray Train wrapper: raywds's own runs in a TorchTrainer (raywds.launch.ownloop runs a loop of
yours). Each Ray touchpoint is marked `# RAY`.

raywds ray --data http://head:8080 --model resnet50          # one worker per cluster GPU
ray job submit --address http://127.0.0.1:8265 -- raywds ray --demo
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchConfig, TorchTrainer

from raywds import console
from raywds.data import stores
from raywds.data.dataset import index_of, manifest_of
from raywds.data.manifest import Manifest
from raywds.errors import ConfigError, RaywdsError, one_line, own_cause
from raywds.launch.cluster import (
    WorkerPlan,
    alive_nodes,
    connect,
    environ,
    lost_since,
    node_count,
    node_ip,
    plan_workers,
    split_storage,
    start_autoscaling_coordinator,
    wait_for_coordinator,
)
from raywds.launch.ray_validation import Landing, described, task_resources, validation_config
from raywds.launch.raydata import Plane, RayData
from raywds.launch.rayoptions import DEFAULTS, RayOptions
from raywds.launch.runstore import as_uri, hold_run_folder, load_ray_checkpoint, open_run_dir, ray_storage
from raywds.loader.decodings import decoding
from raywds.plan.checks import check_plan
from raywds.plan.modes import epoch_plan
from raywds.runs import files
from raywds.runs.checkpoint import load_checkpoint, save_checkpoint
from raywds.runs.folder import Metrics, RunDir
from raywds.runs.rows import kind
from raywds.train.config import TrainConfig
from raywds.train.notice import Notice
from raywds.train.state import check_unfinished, saved_progress
from raywds.train.trainer import train
from raywds.world import World

POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
POLL_S = 0.5
"""How often Ray Train's controller polls the workers, where raywds sets it (Ray's default: 2 s).
The poll is also how a worker's `ray.train.report` reaches the controller: each worker holds one
report at a time and waits for the next poll to take it, and the controller sees the training
function end only at a poll. On a long-lived cluster a 2-epoch demo run spent 5.9 s after its last
step (validation, checkpoint, shutdown) at 2 s, 3.5 s at 0.5 s (benchmarks/ray_cost.py). A poll
that is late is waited for at the next one, silently; a worker is taken for dead only after Ray's
10 minutes of hanging polls, whatever the interval."""
MAX_POLLED_WORKERS = 64
"""Above this many workers raywds leaves Ray's 2 s: each poll is a call to every worker."""


def controller_polls(num_workers: int) -> dict[str, str]:
    """The controller's poll interval for a run of `num_workers`, as the environment Ray Train
    hands its controller (a user's own RAY_TRAIN_HEALTH_CHECK_INTERVAL_S wins: `cluster.environ`)."""
    return {POLL_ENV: str(POLL_S)} if num_workers <= MAX_POLLED_WORKERS else {}


log = logging.getLogger(__name__)

PLANE_TASK_CPUS = 1.0
"""CPUs one Ray Data read-and-decode task reserves."""


def report_to_ray(
    metrics: Metrics,
    state: dict[str, Any] | None,
    run_dir: RunDir | None = None,
    *,
    landing: Landing | None = None,
    validate: bool = False,
) -> None:
    """Every rank reports; rank 0 attaches the checkpoint (with the row it reports, metrics.json),
    so Result.metrics is filled, and records the metrics and best/ in the run folder (a local or
    shared storage path). `validate`: Ray validates the checkpoint in a task of its own
    (raywds.launch.ray_validation), whose numbers rank 0 then lands, with what else has finished."""
    if state is not None and run_dir is not None:
        run_dir.record(metrics, state)  # Ray keeps the last K checkpoints; best/ keeps the best by top-1
    if state is None:
        ray.train.report(metrics)  # RAY
        return
    if run_dir is not None:  # the tracking runs' ids, which a restart from this checkpoint continues
        state = {**state, "tracking": run_dir.tracking_ids()}
    with tempfile.TemporaryDirectory(prefix="raywds-ckpt-") as tmp:
        save_checkpoint(state, Path(tmp) / files.CHECKPOINT, durable=False)  # Ray copies it to the storage
        (Path(tmp) / files.CHECKPOINT_ROW).write_text(json.dumps(metrics) + "\n")
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), validation=validate)  # RAY
    if landing is not None:
        landing.land(metrics)


def quiet_ray_reports() -> None:
    """Ray Train (2.60) logs every report at INFO, a whole metrics dict per rank, through a
    logger named after its source file, which RunConfig's LoggingConfig does not reach (it
    filters `ray.train*` loggers only). Raise that one logger to WARNING."""
    try:
        from ray.train.v2._internal.execution import context  # RAY: internal; gone in another Ray, nothing to quiet
    except ImportError:
        return
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def preemption_notice() -> Notice | None:
    """Ray Train's notice that a node of the run is being drained for preemption (a collective:
    every rank asks at the same steps), as raywds's Notice."""
    info = ray.train.get_preemption_info()  # RAY
    if info is None:
        return None
    deadline = info.deadline_ms / 1000 if info.deadline_ms else None
    return Notice("preemption", deadline, tuple(info.preempted_node_ids))


TRACKING_PREFIXES = ("MLFLOW_", "WANDB_")
SECRET_WORDS = ("KEY", "TOKEN", "PASSWORD", "SECRET")


def tracking_env() -> dict[str, str]:
    """The driver's MLFLOW_* and WANDB_* settings (where to track, the experiment, the project,
    offline mode), which rank 0 on another machine needs to track the same way; not their
    credentials (…KEY, …TOKEN, …PASSWORD, …SECRET), which each node keeps as the tool expects."""
    return {
        name: value
        for name, value in os.environ.items()
        if name.startswith(TRACKING_PREFIXES) and not any(word in name for word in SECRET_WORDS)
    }


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Runs in every Ray Train worker: build the world from Ray's context, then train."""
    quiet_ray_reports()
    console.configure()
    for name, value in config.get("tracking_env", {}).items():
        os.environ.setdefault(name, value)  # the node's own setting wins
    cfg = TrainConfig.from_dict(config["config"])
    loaders = RayData(Plane(**config["plane"])) if config.get("plane") else None
    manifest = manifest_of(cfg, trusted=config["index"]) if config.get("index") else None  # the driver's index
    context = ray.train.get_context()  # RAY
    world = World(
        rank=context.get_world_rank(),
        world_size=context.get_world_size(),
        local_rank=context.get_local_rank(),
        ranks_per_node=context.get_local_world_size(),
        device=str(ray.train.torch.get_device()),  # RAY
        idle_cpus=ray.available_resources().get("CPU", 0.0),  # RAY
    )
    log.info(f"rank {world.rank} of {world.world_size} on node {node_ip()} (pid {os.getpid()})")
    resume = None
    checkpoint = ray.train.get_checkpoint()  # RAY: set when Ray restarts the run after a failure
    if checkpoint is not None:
        resume = load_ray_checkpoint(checkpoint)
        if world.is_main:
            steps = saved_progress(resume)["steps"]
            log.info(f"restarted: resuming from the checkpoint at step {steps} on {world.world_size} rank(s)")
    run_dir = open_run_dir(cfg) if world.is_main else None
    try:
        landing = Landing(run_dir, cfg.validates) if world.is_main and config.get("async_validation") else None
        report = functools.partial(report_to_ray, run_dir=run_dir, landing=landing)
        apart = functools.partial(report, validate=True) if config.get("async_validation") else None
        train(
            cfg,
            world,
            report,
            resume,
            run_dir=run_dir,
            loaders=loaders,
            manifest=manifest,
            notices=preemption_notice,
            apart=apart,
        )
        if landing is not None:  # the validations still running: their rows and best/ before the run ends
            landing.land(wait=True)
    finally:
        if run_dir is not None:
            run_dir.close(artifact=cfg.tracking_checkpoint)


def worker_error(failed: Exception) -> RaywdsError | None:
    """The first rank's own raywds error inside Ray's failure, in its own words (a bad shard
    or sample is one line, as in a local run), so the CLI need not show Ray's snippets."""
    failures = getattr(failed, "worker_failures", None) or {}  # RAY: WorkerGroupError's rank -> exception
    for rank, failure in sorted(failures.items()):
        own = own_cause(failure)
        if own is not None:
            return type(own)(f"{one_line(own)} (rank {rank})")
    return None


@dataclass(frozen=True)
class RayRun:
    metrics: Metrics
    checkpoint: str | None
    path: str
    plan: WorkerPlan
    history: list[Metrics]
    """Metrics of every finished epoch whose checkpoint was kept, oldest first."""


PATHS = ("data", "val_data", "shards_at", "index_cache", "cache_dir", "audit_dir", "initial_checkpoint")
"""The settings that may name a local path, which Ray's workers resolve in a folder of their own."""


def absolute(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its relative local paths made absolute: a worker runs in Ray's own folder, where
    `--data runs/demo/shards` names nothing (URLs, `pipe:` commands and lists of servers stay)."""
    paths: dict[str, Any] = {}
    for name in PATHS:
        value = getattr(cfg, name)
        if value and "," not in value and stores.scheme(value) == stores.LOCAL:
            path = stores.local_path(value)
            paths[name] = path if os.path.isabs(path) else os.path.abspath(path)
    return dataclasses.replace(cfg, **paths)


def check_global_batch(cfg: TrainConfig, fewest: int, most: int) -> None:
    """Refuse, in one line, a --global-batch that some world an elastic run may take cannot reach."""
    if cfg.global_batch is None:
        return
    cannot = [w for w in range(fewest, most + 1) if cfg.global_batch % (w * cfg.batch_size)]
    if cannot:
        every = math.lcm(*(w * cfg.batch_size for w in range(fewest, most + 1)))
        raise ConfigError(
            f"--global-batch {cfg.global_batch} cannot be reached by {', '.join(map(str, cannot))} rank(s) of "
            f"--batch-size {cfg.batch_size} (--num-workers {fewest}..{most}): make it a multiple of {every}"
        )


def run(cfg: TrainConfig, options: RayOptions = DEFAULTS) -> RayRun:
    """Train `cfg` with a TorchTrainer on the cluster in `options.address` (joined as `raywds ray`
    joins it, unless this process has joined one already), as `options` say; returns rank 0's
    last metrics. `num_workers` (MIN, MAX) is elastic; after a failure (a worker or its node lost)
    Ray restarts the workers up to `max_failures` times, each time from the latest checkpoint, and
    as often waits `node_wait_s` (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s) for the workers to
    fit. `data_plane` "ray": Ray Data tasks read and decode on any node (raywds.launch.raydata), each
    rank's pipeline holding at most `plane_store_mb` of blocks in the object store.
    `worker_resource`: custom Ray resources each training worker reserves (where it may run)."""
    if options.node_wait_s is not None:  # Ray Train reads it in the driver and hands it to its controller
        os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(options.node_wait_s)
    connect(options.address)  # raywds's runtime env for the run's processes, and Ray stopped with a Jupyter kernel
    coordinator = start_autoscaling_coordinator()  # started already where connect() joined the cluster
    cfg, plan, plane = place(absolute(cfg), options)
    manifest = manifest_of(cfg)
    for size in {plan.min_workers or plan.num_workers, plan.num_workers}:  # refuse a plan that would hang
        check_plan(epoch_plan(manifest, cfg, size, epoch=0), manifest)
    check_global_batch(cfg, plan.min_workers or plan.num_workers, plan.num_workers)
    if cfg.resume:
        resume = os.path.abspath(cfg.resume)
        cfg = dataclasses.replace(cfg, resume=resume)
        # Fail here in one line (no such file, damaged, not ours, nothing left to train), not in every worker.
        check_unfinished(load_checkpoint(resume), cfg)
    nodes = alive_nodes()
    reserved = validation_resources(cfg, manifest, plan, plane, options)
    decoding = f", decoding on Ray Data tasks of {PLANE_TASK_CPUS:g} CPU anywhere in the cluster" if plane else ""
    apart = f", validating each epoch's checkpoint in a Ray task on {described(reserved)}" if reserved else ""
    print(f"raywds: training on {plan.describe()} ({len(nodes)} node(s)){decoding}{apart}", flush=True)
    storage, local = split_storage(options.storage_path)
    name = options.name or time.strftime("raywds-%Y%m%d-%H%M%S")
    # Rank 0 appends metrics.jsonl to the run folder where it is a path (local, shared or file://).
    cfg = dataclasses.replace(cfg, out=os.path.join(local or storage, name))
    with hold_run_folder(cfg, local):
        trainer = make_trainer(cfg, plan, storage, name, options, plane, reserved)
        wait_for_coordinator(coordinator)
        try:
            with environ(controller_polls(plan.num_workers)):  # read as fit() starts the controller
                result = trainer.fit()
        except ray.train.TrainingFailedError as e:  # RAY
            raise failure(e, lost_since(nodes), options.max_failures) from e
        except KeyboardInterrupt as e:  # SIGTERM or Ctrl-C to this driver (raywds.cli: one line, 143 or 130)
            e.add_note(
                f"the workers end with this driver; the run's checkpoints are in {os.path.join(storage, name)}: "
                "resume from the newest checkpoint_* folder there with --resume"
            )
            raise
    if not result.metrics:
        raise RaywdsError(f"Ray training reported no metrics; see the run at {result.path}")
    checkpoint = as_uri(result.checkpoint.path, storage) if result.checkpoint is not None else None
    history = sorted(
        (dict(m) for _, m in result.best_checkpoints or [] if kind(m) == "epoch"), key=lambda m: m["epoch"]
    )
    last = dict(result.metrics)
    if reserved:  # the last epoch's validation, done apart, came after its report
        last.update(next((m for m in history if m["epoch"] == last.get("epoch") and kind(last) == "epoch"), {}))
    return RayRun(last, checkpoint, as_uri(result.path, storage), plan, history)


def validation_resources(
    cfg: TrainConfig, manifest: Manifest, plan: WorkerPlan, plane: Plane | None, options: RayOptions
) -> dict[str, float] | None:
    """With --async-validation, what each validation task reserves (raywds.launch.ray_validation);
    None without. Refuses, in one line, data with nothing to validate on."""
    if not options.async_validation:
        return None
    if "val" not in manifest.splits:
        raise ConfigError(
            f"--async-validation: --data {cfg.data} has no val split to validate on; give --val-data, "
            "or leave out --async-validation"
        )
    held = plan.num_workers * plan.cpus_per_worker + (PLANE_TASK_CPUS if plane is not None else 0)
    return task_resources(ray.cluster_resources(), plan, held)  # RAY


def place(cfg: TrainConfig, options: RayOptions) -> tuple[TrainConfig, WorkerPlan, Plane | None]:
    """The config the workers get, the workers the cluster can hold, and the Ray Data plane's
    settings (None for each rank's own loader)."""
    if options.data_plane not in PLACES:
        raise ConfigError(f"--data-plane {options.data_plane!r} is not one of {', '.join(PLACES)}")
    return PLACES[options.data_plane](cfg, options)


def _own_loaders(cfg: TrainConfig, options: RayOptions) -> tuple[TrainConfig, WorkerPlan, None]:
    """`--data-plane loader`: each rank reads and decodes with its own DataLoader workers."""
    workers = cfg.loader_workers  # auto: every CPU the cluster has per GPU
    plan = plan_workers(
        ray.cluster_resources(), options.num_workers, loader_workers=None if workers == "auto" else workers
    )  # RAY
    return cfg, plan, None


def _ray_data(cfg: TrainConfig, options: RayOptions) -> tuple[TrainConfig, WorkerPlan, Plane]:
    """`--data-plane ray`: Ray Data tasks on any node read and decode each rank's shards."""
    if not decoding(cfg.decode).in_workers:
        raise ConfigError(
            f"--decode {cfg.decode} needs each rank's own loader: use --data-plane loader or --decode cpu"
        )
    # No DataLoader workers: each rank is one slot of the plan, its shards read by Ray Data tasks.
    cfg = dataclasses.replace(cfg, loader_workers=0)
    plan = plan_workers(ray.cluster_resources(), options.num_workers, plane_task_cpus=PLANE_TASK_CPUS)  # RAY
    plane = Plane(
        task_cpus=PLANE_TASK_CPUS,
        object_store_bytes_per_rank=options.plane_store_mb << 20,
        executor=options.plane_executor,
        trainer_cpus=plan.num_workers * plan.cpus_per_worker,
        trainer_gpus=plan.num_workers if plan.use_gpu else 0,
    )
    return cfg, plan, plane


PLACES = {"loader": _own_loaders, "ray": _ray_data}
"""Each --data-plane (raywds.launch.rayoptions.DATA_PLANES): where the data is read and decoded."""


def make_trainer(
    cfg: TrainConfig,
    plan: WorkerPlan,
    storage: str,
    name: str,
    options: RayOptions,
    plane: Plane | None = None,
    validation: dict[str, float] | None = None,
) -> TorchTrainer:
    """The TorchTrainer that runs train_loop_per_worker on `plan`'s workers, as run `name` in
    `storage` (options.storage_path made absolute); `validation`: the resources of each epoch's
    validation task (--async-validation), None where the ranks validate."""
    return TorchTrainer(  # RAY
        train_loop_per_worker,
        train_loop_config={
            "config": cfg.to_dict(),
            "plane": plane and dataclasses.asdict(plane),
            "index": index_of(cfg),
            "tracking_env": tracking_env() if cfg.trackers() else {},
            "async_validation": validation is not None,
        },
        validation_config=validation_config(validation) if validation is not None else None,
        scaling_config=ray.train.ScalingConfig(
            num_workers=plan.ray_num_workers,  # type: ignore[arg-type]  # V2 takes (min, max); mypy sees V1's
            use_gpu=plan.use_gpu,
            resources_per_worker={"CPU": plan.cpus_per_worker, **dict(options.worker_resource or [])},
            elastic_resize_monitor_interval_s=options.resize_check_s,  # type: ignore[call-arg]
        ),
        torch_config=TorchConfig(backend="nccl" if plan.use_gpu else "gloo", timeout_s=cfg.pg_timeout),
        run_config=ray.train.RunConfig(
            name=name,
            **ray_storage(storage, cfg.s3_endpoint),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=options.keep_checkpoints),
            # After a worker dies, Ray restarts the group and each worker resumes from the latest
            # checkpoint. Starting a group that cannot be placed (a fixed count, a node gone) is a
            # controller failure, unbounded by default: bound it too, so a lost node is an error.
            failure_config=ray.train.FailureConfig(  # type: ignore[call-arg]  # V2's FailureConfig; mypy sees V1's
                max_failures=options.max_failures, controller_failure_limit=options.max_failures
            ),
            # Ray Train's INFO lines (each checkpoint's path; see also quiet_ray_reports) would
            # bury raywds's epoch lines; they still go to Ray's system log files (logs/train).
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),  # type: ignore[call-arg]  # V2's RunConfig; mypy sees V1's
        ),
    )


def failure(e: Exception, lost: list[str], max_failures: int) -> RaywdsError:
    """The error a failed run ends with: a rank's own raywds error, else the nodes lost, else Ray's."""
    own = worker_error(e)
    if own is not None and not lost:
        return own
    if lost:
        restarts = f"after {max_failures} restart{'s' if max_failures != 1 else ''} (--max-failures)"
        cause = f"; the rank that failed first: {one_line(own)}" if own is not None else ""
        return RaywdsError(
            f"lost node(s) {', '.join(lost)} during the run and could not go on {restarts}{cause}. "
            "Bring the node back and rerun with the same --name to resume from the latest checkpoint, "
            "or give --num-workers MIN..MAX to go on with fewer workers"
        )
    return RaywdsError(f"Ray training failed: {e}")


__all__ = ["RayOptions", "RayRun", "WorkerPlan", "connect", "node_count", "node_ip", "plan_workers", "run"]
