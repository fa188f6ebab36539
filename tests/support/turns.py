"""Turns between pytest-xdist's workers for what must not start Ray beside another Ray run.

Ray's `ray start` gives its node 30 s (a constant in ray/_private/node.py, no setting) to
register with the GCS, then exits with "The current node timed out during startup". On a slow
2-core machine, the image's two containers starting Ray beside a Ray Train run in the other
worker (load average 9) took longer, and the test failed though nothing of raywds's was wrong.
So the Ray tests take a turn each (tests/conftest.py), and the container cluster test waits for
one (tests/deploy/test_image.py): both cores stay busy, as the suite is bound by CPU, and the
two never start Ray at once.

The turn is fair: a worker waiting for it holds the gate, so the worker that just gave the turn
up cannot take it straight back for its next test (Linux wakes a waiter on flock's release, but
which of the two then locks first is a race without the gate). One run's workers share the lock
files in the run's temp folder, which pytest prunes; without xdist there is one process and
nothing to wait for.

    with turn(folder(tmp_path_factory)):
        start_ray_in_the_containers()
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

GATE, TURN = "gate", "turn"
"""The lock files' names in the run's folder: the gate a waiter holds, and the turn itself."""


def folder(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """Where this run's workers keep the lock files (the folder above each worker's own temp
    folder, the run's); None when pytest runs without xdist."""
    return tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None


@contextmanager
def turn(where: Path | None) -> Iterator[None]:
    """Hold the turn of the run whose lock files are in `where`: no other worker holds it until
    the block ends (`where` None: nothing to wait for)."""
    if where is None:
        yield
        return
    with open(where / GATE, "a") as gate, open(where / TURN, "a") as held:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(held, fcntl.LOCK_EX)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
