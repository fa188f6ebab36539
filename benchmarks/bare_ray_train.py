"""A Ray Train run that trains nothing: what any Ray Train job pays before and after its work.

    .venv/bin/python benchmarks/bare_ray_train.py OUT [ADDRESS]

Plain Ray Train, none of raywds in it: `ray.init` (a local cluster with Ray's defaults, or the
cluster at ADDRESS), a `TorchTrainer` of 2 workers on the gloo backend, and a training function
that only passes a barrier 8 times, rank 0 writing a progress row each time to OUT/metrics.jsonl
(the rows benchmarks/ray_cost.py reads), then returns. The controller polls its workers every
0.5 s, as under `raywds ray` (raywds.launch.ray_train.controller_polls), so the time after the last step compares.
So the first row is the time Ray Train takes to reach a training function with its process group
joined, and the time after the last row its teardown: Ray's floor for any run on this machine.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ray
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig, get_context
from ray.train.torch import TorchTrainer

from raywds.launch.cluster import environ
from raywds.launch.ray_train import controller_polls

STEPS = 8


def train_fn(config: dict) -> None:
    for step in range(STEPS):
        dist.barrier()
        if get_context().get_world_rank() == 0:
            row = {"kind": "progress", "time": time.time(), "epoch": 0, "step_in_epoch": step}
            with open(config["metrics"], "a") as f:
                f.write(json.dumps(row) + "\n")


def main() -> None:
    if len(sys.argv) not in (2, 3) or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__.split("\n\n")[1])  # the usage line; benchmarks/ray_cost.py --bare runs it
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    ray.init(address=sys.argv[2] if len(sys.argv) > 2 else None)
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"metrics": str(out / "metrics.jsonl")},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=str(out), name="bare"),
    )
    with environ(controller_polls(2)):  # as raywds.launch.ray_train.run sets it: a user's own value wins
        trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
