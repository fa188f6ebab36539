"""Where each rank's step time went in an epoch, as the epoch's metrics row holds it
(`stages`), read back: each rank's steps (`steps`) and the parts of its epoch (`shares`), for
`raywds report`, TensorBoard and the doctor (raywds.train.doctor, which adds each rank's loader
clock: raywds.train.timing.ranks).

A step is the wait for its batch, the copy to the device, the forward pass and the backward
pass with the optimizer step. Ranks meet in collectives in both passes (DDP's buffer broadcast,
the gradient all-reduce), so a rank that waits for a slower one spends as long in them as that
rank; what tells them apart is each rank's own compute in the passes (`own_s`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NUMBERS = ("seconds", "samples", "wait_s", "handover_s", "startup_s", "copy_s", "forward_s", "backward_s", "own_s")
"""Each rank's step times, in the order the trainer gathers them."""
LOADER = ("read_s", "decode_s", "collate_s", "read_bytes", "decoded", "resize_s", "shards")
"""Each rank's loader clock (raywds.loader.clock.Spent), in the order the trainer gathers them."""


@dataclass(frozen=True)
class Steps:
    """One rank's steps in an epoch, from a metrics row's `stages`."""

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
    """Of its passes, the time this rank waited in collectives for a slower one."""

    @property
    def waits(self) -> float:
        """The share of its steps the rank waited for data, less its loader workers' start."""
        return (self.wait_s - self.startup_s) / max(self.seconds - self.startup_s, 1e-9)

    @property
    def model_rate(self) -> float:
        """Images a second the rank's model would take if the data were always there."""
        return self.samples / max(self.copy_s + self.forward_s + self.backward_s - self.blocked_s, 1e-9)

    @property
    def where(self) -> str:
        return f"rank {self.rank} on {self.host}"


def steps(stages: dict[str, Any]) -> list[Steps]:
    """Each rank's steps; ranks meet at every step, so a rank whose own compute per sample is a
    share of the slowest's spends the rest of its passes waiting for it (`blocked_s`)."""
    per_sample = [own / max(n, 1) for own, n in zip(stages["own_s"], stages["samples"])]
    slowest = max(per_sample)
    out = []
    for r, host in enumerate(stages["host"]):
        numbers = {key: float(stages[key][r]) for key in NUMBERS}
        passes = numbers["forward_s"] + numbers["backward_s"]
        blocked = passes * (1 - per_sample[r] / slowest) if slowest > 0 else 0.0
        out.append(Steps(rank=r, host=host, **numbers, blocked_s=blocked))
    return out


SHARES = ("data wait", "copy", "compute", "waiting for other ranks", "other")
"""Where each rank's epoch went (`shares`): the stacked bars of `raywds report` and TensorBoard's
`epoch/step_time/...` charts."""


def shares(stages: dict[str, Any]) -> dict[str, list[float]]:
    """Each SHARES part of each rank's epoch, as a fraction of it ("other": the loop's own
    bookkeeping, checkpoints and the loader's start)."""
    out: dict[str, list[float]] = {name: [] for name in SHARES}
    for r in steps(stages):
        whole = max(r.seconds, 1e-9)
        parts = [r.wait_s, r.copy_s, r.forward_s + r.backward_s - r.blocked_s, r.blocked_s]
        for name, part in zip(SHARES, [*parts, max(whole - sum(parts), 0.0)]):
            out[name].append(round(part / whole, 4))
    return out
