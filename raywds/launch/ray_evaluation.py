"""`raywds evaluate MODEL --data SHARDS --ray`: an evaluation's ranks as Ray tasks, one a GPU of the
cluster (on a cluster without GPUs, --num-workers tasks of one CPU each, 2 unless told: the workers
`raywds ray` would train on, raywds.launch.cluster.plan_workers). Each task scores its rank's share
of the split as a torchrun rank does (raywds.infer.evaluation) and returns its sums; the driver adds
them in place of the all_reduce, so there is no process group and no task waits for another. The
model travels in Ray's object store (MODEL need only be on the driver's disk); the shards must be
where every node reads them (a shared folder, http, s3://, gs://). Each Ray touchpoint is marked `# RAY`.

    scored = evaluate_on_ray(trained, cfg, split="val", address=None, num_workers=4)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import ray

from raywds.data import stores
from raywds.errors import RaywdsError, one_line, own_cause
from raywds.infer.evaluation import Scored, Scoring, Sums
from raywds.launch import cluster
from raywds.models.trained import Trained
from raywds.train.config import TrainConfig
from raywds.world import World

log = logging.getLogger(__name__)

MAX_RETRIES = 2
"""Times Ray runs a rank's task again after its worker process or node died; an error the task
raises itself (a bad shard) is final."""
PATHS = ("data", "val_data", "shards_at", "index_cache", "cache_dir")
"""The reading settings that may name a local path, which a task resolves in a folder of Ray's."""


def _rank(scoring: Scoring, rank: int, world_size: int) -> Sums:
    """Rank `rank`'s sums, on the task's GPU where it has one (Ray makes it the only one it sees)."""
    device = "cuda:0" if ray.get_gpu_ids() else "cpu"  # RAY
    return scoring.rank_sums(World(rank=rank, world_size=world_size, device=device)).to("cpu")


def absolute(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its relative local paths made absolute (URLs, `pipe:` commands and lists of servers stay)."""
    paths: dict[str, Any] = {}
    for name in PATHS:
        value = getattr(cfg, name)
        if value and "," not in value and stores.scheme(value) == stores.LOCAL:
            paths[name] = os.path.abspath(stores.local_path(value))
    return dataclasses.replace(cfg, **paths)


def _sums(ref: Any, rank: int) -> Sums:
    """The task's sums; its own raywds error as it is (naming the rank), Ray's in one line."""
    try:
        return ray.get(ref)  # type: ignore[no-any-return]  # RAY
    except ray.exceptions.RayError as e:  # RAY: the task raised, or its worker died more often than retried
        own = own_cause(e)
        if own is not None:
            raise type(own)(f"{one_line(own)} (rank {rank})") from None
        raise RaywdsError(f"rank {rank}'s evaluation failed on the cluster: {one_line(e)[:500]}") from None


def evaluate_on_ray(
    trained: Trained,
    cfg: TrainConfig,
    *,
    split: str = "val",
    ema: bool = False,
    address: str | None = None,
    num_workers: int | None = None,
) -> Scored:
    """Score `trained` on `split` of cfg.data with Ray tasks on the cluster at `address` (RAY_ADDRESS,
    a running `ray start`, else a new local one): every sample once, the numbers of one process."""
    cluster.connect(address, training=False)
    scoring = Scoring.of(trained, absolute(cfg), split=split, ema=ema)  # refused here, before any task
    plan, task = cluster.rank_tasks(_rank, cfg.loader_workers, num_workers, MAX_RETRIES)
    each = "a GPU" if plan.use_gpu else f"{plan.cpus_per_worker:g} CPU"
    log.info(f"evaluating with {plan.num_workers} Ray tasks, {each} each")
    shared = ray.put(scoring)  # RAY: the model once into the object store, not once a task
    refs = [task.remote(shared, rank, plan.num_workers) for rank in range(plan.num_workers)]  # RAY
    return scoring.scored(functools.reduce(Sums.plus, [_sums(ref, rank) for rank, ref in enumerate(refs)]))
