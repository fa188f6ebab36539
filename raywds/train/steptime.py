"""Marks inside a training step, for where its time goes (raywds.train.doctor): the host's clock
on a CPU; CUDA events on a GPU, where the host only queues the work (read once the step's loss
has come back to the host, so reading them never waits).

    timer = StepTimer(world.device)
    marks = [timer.mark(), ...]
    copy_s, forward_s, backward_s = timer.between(marks)
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

SLOW_RANK = "RAYWDS_TEST_SLOW_RANK"
"""`RANK:SECONDS`: that rank computes so much longer in each step's forward pass (spinning on
its CPU), a slow GPU planted by the tests (tests/train/test_doctor.py); `*:SECONDS`: every rank
that sees it, set on one node only, a slow node (tests/launch/test_multinode.py)."""


def spin(seconds: float) -> None:
    """Keep this CPU busy for `seconds` of its CPU time: work, as a slower processor would do, not
    a sleep (on a busy machine it takes longer, as the rank's other work does)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def slowed_rank(rank: int) -> float:
    """Seconds this rank spins in each forward pass (SLOW_RANK), 0 for all but the planted ranks."""
    planted = os.environ.get(SLOW_RANK, "")
    if not planted:
        return 0.0
    which, seconds = planted.split(":")
    return float(seconds) if which == "*" or int(which) == rank else 0.0


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
