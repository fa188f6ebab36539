"""Notice that this run is about to lose a node or its processes: Ray Train's preemption notice
(the launcher asks `ray.train.get_preemption_info()`: raywds.launch.ray_train), or SIGTERM, which
Kubernetes sends a pod before it kills it (after `terminationGracePeriodSeconds`), torchrun's
agent forwards to its ranks, and a spot VM's shutdown sends its processes.

The trainer asks at the same steps on every rank (`--notice-every` steps, while every rank is
still in the loop): asking is a collective. On a notice it checkpoints inside the epoch at once;
on SIGTERM it then stops, on Ray's notice it waits for the node to go (raywds.train.trainer).

    notices = Sigterm(world)          # raywds train, under torchrun or alone
    notice = notices()                # every rank, the same steps: None, or the notice
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raywds.world import World

GRACE_S = 30.0
"""What a SIGTERM leaves, unless told otherwise: Kubernetes' default terminationGracePeriodSeconds."""


@dataclass(frozen=True)
class Notice:
    reason: str
    """`preemption` (Ray's notice of a node's drain) or `sigterm`."""
    deadline: float | None
    """When the node or process goes (Unix seconds), where known."""
    nodes: tuple[str, ...] = ()
    """The nodes that go (Ray's node ids), or the hosts that got SIGTERM."""

    def row(self) -> dict[str, Any]:
        """What a checkpoint row taken on the notice says of it."""
        return {"reason": self.reason, "deadline": self.deadline, "nodes": list(self.nodes)}


Notices = Callable[[], "Notice | None"]
"""Asked by every rank at the same steps (a collective): the notice, or None."""


class Sigterm:
    """SIGTERM to any rank of this job as a notice to every rank; a second SIGTERM to a process
    ends it at once (exit 143), as before. Installed only in the main thread."""

    def __init__(self, world: World, grace_s: float = GRACE_S):
        self.world, self.grace_s = world, grace_s
        self.received = 0.0
        self._before: Any = None
        if threading.current_thread() is threading.main_thread():
            self._before = signal.signal(signal.SIGTERM, self._got)

    def _got(self, signum: int, frame: Any) -> None:
        if self.received:
            sys.exit(128 + signum)
        self.received = time.time()

    def close(self) -> None:
        """Give SIGTERM back to what handled it before."""
        if self._before is not None:
            signal.signal(signal.SIGTERM, self._before)
            self._before = None

    def __call__(self) -> Notice | None:
        received, hosts = self.received, (socket.gethostname(),) if self.received else ()
        if self.world.distributed:  # any rank's SIGTERM is every rank's notice
            device = self.world.device if self.world.device.startswith("cuda") else "cpu"  # NCCL: on the GPU
            seen = torch.tensor([received], dtype=torch.float64, device=device)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            received = float(seen.item())
            hosts = ()
        if not received:
            return None
        return Notice("sigterm", received + self.grace_s, hosts)
