"""`raywds predict` without Ray: in this process, or as one rank of a torchrun job (the world from
RANK, WORLD_SIZE and LOCAL_RANK, as `raywds train` takes it); each rank writes its own parts
(raywds.infer.prediction) and rank 0 says what the job did, the ranks' counts added with one
all_reduce at the end.

    raywds predict runs/local --data shards/ --out preds                                  # one process
    torchrun --nproc-per-node 4 -m raywds predict runs/local --data shards/ --out preds  # four ranks
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from raywds.infer.prediction import Tally, predict_rank, summed
from raywds.infer.predictoptions import Prediction
from raywds.launch.evaluation import process_group
from raywds.train.config import TrainConfig
from raywds.world import World


def predict_here(job: Prediction, reading: Mapping[str, Any]) -> tuple[Tally, float] | None:
    """Predict `job` as this process's rank of torchrun's world (else rank 0 of 1; `reading`: the
    reading flags given, as TrainConfig names them); rank 0 gets the job's tally and seconds."""
    world = World.from_env()
    started = time.perf_counter()
    with process_group(world, reading.get("pg_timeout") or TrainConfig.pg_timeout):
        tally = summed(predict_rank(job, reading, world), world)
    return (tally, time.perf_counter() - started) if world.is_main else None
