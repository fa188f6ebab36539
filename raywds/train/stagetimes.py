"""Where each rank's step time went in an epoch, gathered into the epoch's metrics row
(`stages`) on every rank, and read back from it: each rank's numbers (`ranks`) and the parts
of its epoch (`shares`), for the doctor's verdict (raywds.train.doctor), `--loader-workers
auto` (raywds.train.autoworkers), `raywds report` and TensorBoard.

A step is the wait for its batch, the copy to the device, the forward pass and the backward
pass with the optimizer step. Ranks meet in collectives in both passes (DDP's buffer broadcast,
the gradient all-reduce), so a rank that waits for a slower one spends as long in them as that
rank; what tells them apart is each rank's own compute in the passes (raywds.train.steptime).
The loader's workers time their reading, decoding and collating (raywds.loader.clock).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from raywds.config import TrainConfig
from raywds.loader.clock import Spent
from raywds.train.ledger import gathered, per_rank
from raywds.train.loop import EpochResult
from raywds.world import World

NUMBERS = ("seconds", "samples", "wait_s", "handover_s", "startup_s", "copy_s", "forward_s", "backward_s", "own_s")

LOADER = ("read_s", "decode_s", "collate_s", "read_bytes", "decoded", "resize_s", "shards")


def stage_times(
    world: World, result: EpochResult, cfg: TrainConfig, data_from: str, *, alone: bool = False
) -> dict[str, Any]:
    """Every rank's step times and loader stages for the epoch, on every rank (two collectives);
    `alone`: this rank's only, so far, with no collective (rank 0's progress rows)."""
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
    stages["loader_workers"] = cfg.loader_workers
    stages["batch_size"] = cfg.batch_size_per_rank
    stages["cores_per_rank"] = world.cores
    stages["decode"] = cfg.decode
    stages["cache_dir"] = bool(cfg.cache_dir)
    stages["data_from"] = data_from
    stages["device"] = world.device.split(":")[0]
    stages["data_plane"] = spent.plane
    stages["idle_cpus"] = world.idle_cpus
    return stages


@dataclass(frozen=True)
class Rank:
    """One rank's epoch, from a metrics row's `stages`."""

    rank: int
    host: str
    seconds: float
    samples: float
    wait_s: float
    handover_s: float
    startup_s: float
    copy_s: float
    forward_s: float
    backward_s: float
    own_s: float
    blocked_s: float
    loader: Spent

    @property
    def waits(self) -> float:
        """The share of its steps the rank waited for data, less its loader workers' start."""
        return (self.wait_s - self.startup_s) / max(self.seconds - self.startup_s, 1e-9)

    @property
    def model_rate(self) -> float:
        """Images a second the rank's model would take if the data were always there."""
        return self.samples / max(self.copy_s + self.forward_s + self.backward_s - self.blocked_s, 1e-9)

    def loader_rate(self, workers: int) -> float:
        """Images a second the rank's loader makes with `workers` workers (0: the main process)."""
        return self.loader.samples / max(self.loader.busy_s, 1e-9) * max(workers, 1)

    @property
    def where(self) -> str:
        return f"rank {self.rank} on {self.host}"


def ranks(stages: dict[str, Any]) -> list[Rank]:
    per_sample = [own / max(n, 1) for own, n in zip(stages["own_s"], stages["samples"])]
    slowest = max(per_sample)
    out = []
    for r, host in enumerate(stages["host"]):
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
            resize_s=stages.get("resize_s", [0.0] * len(stages["host"]))[r],  # rows written before it was timed
            shards=int(stages.get("shards", [0] * len(stages["host"]))[r]),
        )
        numbers = {key: float(stages[key][r]) for key in NUMBERS}
        # Ranks meet at every step: a rank whose own compute per sample is a share of the
        # slowest's spends the rest of its passes waiting for it.
        passes = numbers["forward_s"] + numbers["backward_s"]
        blocked = passes * (1 - per_sample[r] / slowest) if slowest > 0 else 0.0
        out.append(Rank(rank=r, host=host, **numbers, blocked_s=blocked, loader=spent))
    return out


SHARES = ("data wait", "copy", "compute", "waiting for other ranks", "other")
"""Where each rank's epoch went (`shares`): the stacked bars of `raywds report` and TensorBoard's
`epoch/step_time/...` charts."""


def shares(stages: dict[str, Any]) -> dict[str, list[float]]:
    """Each SHARES part of each rank's epoch, as a fraction of it ("other": the loop's own
    bookkeeping, checkpoints and the loader's start)."""
    out: dict[str, list[float]] = {name: [] for name in SHARES}
    for r in ranks(stages):
        whole = max(r.seconds, 1e-9)
        parts = [r.wait_s, r.copy_s, r.forward_s + r.backward_s - r.blocked_s, r.blocked_s]
        for name, part in zip(SHARES, [*parts, max(whole - sum(parts), 0.0)]):
            out[name].append(round(part / whole, 4))
    return out
