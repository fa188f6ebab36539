"""Train without Ray: in this process, or as one rank of a torchrun job (the world comes
from RANK, WORLD_SIZE and LOCAL_RANK).

    raywds train --data shards/ --model resnet18 --epochs 3                 # one process
    torchrun --nproc-per-node 4 -m raywds train --data shards/             # DDP, same flags
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from raywds.launch import gloo
from raywds.runs import files
from raywds.runs.folder import Metrics, RunDir
from raywds.runs.lock import RunLock
from raywds.train.config import TrainConfig
from raywds.train.notice import Signals
from raywds.train.trainer import train
from raywds.world import World


def resuming_in_place(cfg: TrainConfig) -> bool:
    """True when the run continues from the checkpoint in its own out (metrics.jsonl is kept)."""
    if cfg.resume is None:
        return False
    out = Path(cfg.out).resolve()
    return Path(cfg.resume).resolve() in (out, out / files.CHECKPOINT)


def run_local(cfg: TrainConfig) -> tuple[Metrics, RunDir | None]:
    """Train in this process, or as one rank of a torchrun job; rank 0 returns its run folder."""
    world = World.from_env()
    # Rank 0 holds the run folder, taken before any rank waits on it: a second run into it is refused.
    lock = RunLock(cfg.out) if world.is_main else None
    with lock if lock is not None else contextlib.nullcontext():
        return _run(cfg, world, lock)


def train_in_process(cfg: TrainConfig) -> Metrics:
    """`raywds train` from Python (`raywds.fit`): the run folder `cfg.out` with its lock, the
    process group under torchrun, the epochs; the last epoch's metrics, the same on every rank."""
    return run_local(cfg)[0]


def _run(cfg: TrainConfig, world: World, lock: RunLock | None) -> tuple[Metrics, RunDir | None]:
    if world.distributed:
        backend = "nccl" if world.device.startswith("cuda") else "gloo"
        if world.device.startswith("cuda"):
            torch.cuda.set_device(world.local_rank)
        else:  # listen where the other machines' ranks reach this one: the way to torchrun's rendezvous host
            gloo.listen_on(gloo.address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1")))
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.pg_timeout))
    # Written from the run's start on (its resolved config first), once nothing can refuse it.
    run_dir = RunDir(cfg.out, append=resuming_in_place(cfg), lock=lock) if world.is_main else None
    notices = Signals(world)  # SIGTERM or SIGINT to any rank: a checkpoint inside the epoch, then a stop
    try:
        return train(cfg, world, run_dir=run_dir, notices=notices), run_dir
    finally:
        notices.close()
        if run_dir is not None:
            run_dir.close(artifact=cfg.tracking_checkpoint)
        if world.distributed:
            dist.destroy_process_group()
