"""`raywds evaluate` without Ray: in this process, or as one rank of a torchrun job (the world from
RANK, WORLD_SIZE and LOCAL_RANK, as `raywds train` takes it); the ranks' sums are added with one
all_reduce at the end (raywds.infer.evaluation).

    raywds evaluate runs/local --data shards/                                  # one process
    torchrun --nproc-per-node 3 -m raywds evaluate runs/local --data shards/  # three ranks, same numbers
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from raywds.infer.evaluation import Scored, Scoring, evaluate
from raywds.launch import gloo
from raywds.models.trained import Trained
from raywds.train.config import TrainConfig
from raywds.world import World


@contextlib.contextmanager
def process_group(world: World, timeout_s: float) -> Iterator[None]:
    """torch.distributed's group for a torchrun world of several ranks (nccl on GPUs, else gloo,
    listening where the other machines reach this one); nothing for one process."""
    if not world.distributed:
        yield
        return
    cuda = world.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(world.local_rank)
    else:
        gloo.listen_on(gloo.address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def evaluate_local(trained: Trained, cfg: TrainConfig, *, split: str = "val", ema: bool = False) -> Scored | None:
    """Score `trained` on `split` of cfg.data as this process's rank of torchrun's world (else rank 0
    of 1); rank 0 returns the numbers of every rank, the others None."""
    world = World.from_env()
    with process_group(world, cfg.pg_timeout):
        scored = evaluate(Scoring.of(trained, cfg, split=split, ema=ema), world)
    return scored if world.is_main else None
