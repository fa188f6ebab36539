"""Where a rank's step time goes: marks inside a training step (the host's clock and CPU time on
a CPU; CUDA events on a GPU, where the host only queues the work, read once the step's loss has
come back to the host, so reading them never waits), and each rank's step times and loader
stages gathered into the epoch's row (`stages`, read back by raywds.runs.stagetimes); `ranks`
adds each rank's loader clock to its steps, for the doctor and `--loader-workers auto`.

    timer = StepTimer(world.device)
    marks = [timer.mark(), ...]
    copy_s, forward_s, backward_s = timer.between(marks)
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from raywds.loader.clock import Spent
from raywds.runs.stagetimes import LOADER, NUMBERS, Steps, steps
from raywds.train.config import TrainConfig
from raywds.train.ledger import gathered, per_rank
from raywds.world import World


class StepTimer:
    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter(), time.process_time()

    def between(self, marks: list[Any]) -> list[float]:
        """Seconds between each mark and the next."""
        if self.cuda:
            return [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
        return [b[0] - a[0] for a, b in zip(marks, marks[1:])]

    def own(self, start: Any, end: Any) -> float:
        """The rank's own compute from `start` to `end`, waits in collectives left out as far as
        the device allows: on a CPU this process's CPU seconds (a rank blocked in gloo sleeps);
        on a GPU its time on the device (an NCCL kernel that waits for a slower rank counts)."""
        if self.cuda:
            return float(start.elapsed_time(end) / 1000)
        return float(end[1] - start[1])


def stage_times(world: World, result: Any, cfg: TrainConfig, data_from: str, *, alone: bool = False) -> dict[str, Any]:
    """Every rank's step times and loader stages for the epoch (a raywds.train.loop.EpochResult),
    on every rank (two collectives); `alone`: this rank's only, so far, with no collective (rank
    0's progress rows)."""
    spent, r = result.loader, result
    mine = [r.seconds, r.num_samples, r.data_wait_s, r.handover_s, r.startup_s, r.copy_s, r.forward_s, r.backward_s]
    row = [*mine, r.own_s, spent.read_s, spent.decode_s, spent.collate_s, spent.read_bytes, spent.samples]
    row += [spent.resize_s, spent.shards]
    named = [socket.gethostname(), spent.slow_shard, str(spent.slow_shard_s), str(spent.slow_shard_bytes)]
    table = [row] if alone else per_rank(world, row)
    names = [named] if alone else gathered(world, [named])
    stages: dict[str, Any] = {key: [round(row[i], 4) for row in table] for i, key in enumerate(NUMBERS + LOADER)}
    stages["host"] = [row[0] for row in names]
    stages["slow_shard"] = [[row[1], float(row[2]), int(row[3])] for row in names]
    stages["loader_workers"] = cfg.loader_worker_count
    stages["batch_size"] = cfg.batch_size
    stages["cores_per_rank"] = world.cores
    stages["decode"] = cfg.decode
    stages["cache_dir"] = bool(cfg.cache_dir)
    stages["data_from"] = data_from
    stages["device"] = world.device.split(":")[0]
    stages["data_plane"] = spent.plane
    stages["idle_cpus"] = world.idle_cpus
    return stages


@dataclass(frozen=True)
class Rank(Steps):
    """One rank's epoch, from a metrics row's `stages`: its steps and its loader workers' clock."""

    loader: Spent = Spent()

    def loader_rate(self, workers: int) -> float:
        """Images a second the rank's loader makes with `workers` workers (0: the main process)."""
        return self.loader.samples / max(self.loader.busy_s, 1e-9) * max(workers, 1)


def ranks(stages: dict[str, Any]) -> list[Rank]:
    out = []
    for r, s in enumerate(steps(stages)):
        name, slow_s, slow_bytes = stages["slow_shard"][r]
        spent = Spent(
            stages["read_s"][r],
            stages["decode_s"][r],
            stages["collate_s"][r],
            int(stages["read_bytes"][r]),
            int(stages["decoded"][r]),
            name,
            slow_s,
            slow_bytes,
            resize_s=stages["resize_s"][r],
            shards=int(stages["shards"][r]),
        )
        out.append(Rank(**vars(s), loader=spent))
    return out
