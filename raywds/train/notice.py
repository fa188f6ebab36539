"""Notice that this run is about to lose a node or its processes: Ray Train's preemption notice
(the launcher asks `ray.train.get_preemption_info()`: raywds.launch.ray_train), or a signal:
SIGTERM, which Kubernetes sends a pod before it kills it (after `terminationGracePeriodSeconds`),
Slurm's `scancel` every process of a job step, systemd's stop, `timeout` and `kill -- -PGID` every
process of a group, torchrun's agent its ranks, and a spot VM's shutdown its processes; or SIGINT,
which Ctrl-C sends the terminal's foreground process group.

The trainer asks at the same steps on every rank (`--notice-every` steps, while every rank is
still in the loop): asking is a collective. On a notice it checkpoints inside the epoch at once;
on a signal it then stops, on Ray's notice it waits for the node to go (raywds.train.trainer).

    notices = Signals(world)          # raywds train, under torchrun or alone
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

from raywds.errors import Terminated
from raywds.world import World

GRACE_S = 30.0
"""What a signal leaves, unless told otherwise: Kubernetes' default terminationGracePeriodSeconds."""

SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals a run takes as a notice."""

SAME_DELIVERY_S = 1.0
"""A signal within this long of the first is the same delivery, not a second signal: `timeout`
signals its command and then the command's process group, and torchrun's agent signals its ranks
as it gets the signal that Slurm sent every process, each within milliseconds of the first."""


@dataclass(frozen=True)
class Notice:
    reason: str
    """`preemption` (Ray's notice of a node's drain), `sigterm` or `sigint`."""
    deadline: float | None
    """When the node or process goes (Unix seconds), where known."""
    nodes: tuple[str, ...] = ()
    """The nodes that go (Ray's node ids), or the hosts that got the signal."""
    signum: int | None = None
    """The signal that came (the process is going: it stops after the checkpoint); None for Ray's notice."""

    def row(self) -> dict[str, Any]:
        """What a checkpoint row taken on the notice says of it."""
        return {"reason": self.reason, "deadline": self.deadline, "nodes": list(self.nodes)}

    def stopped(self, after: str) -> Terminated:
        """The error a rank raises after the checkpoint on a signal's notice (`after`: where and how
        to go on): exit code 128 + the signal's number, as a process the signal ends."""
        assert self.signum is not None, "Ray's notice does not stop the run"
        stop = Terminated(f"stopped on {signal.Signals(self.signum).name} {after}")
        stop.exit_code = 128 + self.signum
        return stop


Notices = Callable[[], "Notice | None"]
"""Asked by every rank at the same steps (a collective): the notice, or None."""


class Signals:
    """SIGTERM or SIGINT to any rank of this job as a notice to every rank. A second signal (a
    second after the first, or later: SAME_DELIVERY_S) goes to what handled it before, which
    ends the process at once (raywds's CLI: one line, exit 143 or 130). Installed only in the
    main thread; SIGINT only where it is not ignored (a background job's, nohup's)."""

    def __init__(self, world: World, grace_s: float = GRACE_S):
        self.world, self.grace_s = world, grace_s
        self.received = 0.0
        self.signum = 0
        self._first = 0.0
        self._before: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                if signal.getsignal(signum) != signal.SIG_IGN:
                    self._before[signum] = signal.signal(signum, self._got)

    def _got(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if not self.received:
            self.received, self.signum, self._first = time.time(), signum, now
        elif now - self._first >= SAME_DELIVERY_S:
            self._pass_on(signum, frame)

    def _pass_on(self, signum: int, frame: Any) -> None:
        """A second signal: to the handler from before (the CLI's stop, Python's KeyboardInterrupt),
        now and from now on."""
        before = self._before.get(signum, signal.SIG_DFL)
        self.close()
        try:
            if callable(before):
                before(signum, frame)
            elif before != signal.SIG_IGN:
                sys.exit(128 + signum)
        except KeyboardInterrupt as e:
            e.add_note("a second signal ends the run at once, without a checkpoint: resume from its last one")
            raise

    def close(self) -> None:
        """Give the signals back to what handled them before."""
        before, self._before = self._before, {}
        for signum, handler in before.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def __call__(self) -> Notice | None:
        received, signum = self.received, self.signum
        hosts = (socket.gethostname(),) if received else ()
        if self.world.distributed:  # any rank's signal is every rank's notice
            device = self.world.device if self.world.device.startswith("cuda") else "cpu"  # NCCL: on the GPU
            seen = torch.tensor([received, signum], dtype=torch.float64, device=device)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)  # SIGTERM over SIGINT where ranks got both
            received, signum = float(seen[0].item()), int(seen[1].item())
            hosts = ()
        if not received:
            return None
        name = signal.Signals(signum).name
        return Notice(name.lower(), received + self.grace_s, hosts, signum)
