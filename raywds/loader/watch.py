"""Where each loader worker is reading, so that a worker that falls silent is an error naming
the rank, the worker and the shard instead of a rank waiting for data until the process-group
timeout. Each worker notes the shard it opens in a small file of its own (one write per shard);
the rank reads it when the DataLoader's `timeout` passes without a batch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

from raywds.errors import RaywdsError
from raywds.loader.pool import current_worker


class LoaderStalled(RaywdsError):
    """A loader worker delivered no batch within --loader-timeout."""


class Whereabouts:
    """A folder (in /dev/shm where there is one) of one file per loader worker: the shard it reads."""

    def __init__(self) -> None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.dir = tempfile.mkdtemp(prefix="raywds-loader-", dir=shm)
        self._removed = weakref.finalize(self, shutil.rmtree, self.dir, True)  # in the rank, not its workers

    def __getstate__(self) -> dict[str, str]:
        return {"dir": self.dir}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.dir = state["dir"]

    def note(self, url: str) -> None:
        """In a worker: it opens `url` now."""
        worker = current_worker()
        path = Path(self.dir) / f"worker{worker[0] if worker is not None else 0}"
        try:
            path.write_text(url)
        except OSError:  # a note is a help, never a reason to fail the read
            pass

    def shard(self, worker: int) -> str | None:
        try:
            return (Path(self.dir) / f"worker{worker}").read_text() or None
        except OSError:
            return None

    def stalled(self, rank: int, worker: int | None, timeout_s: float) -> LoaderStalled:
        who = f"loader worker {worker}" if worker is not None else "a loader worker"
        url = self.shard(worker) if worker is not None else None
        where = f"; it was reading {url}" if url else ", before it opened a shard"
        return LoaderStalled(f"rank {rank}: {who} delivered no batch for {timeout_s:.0f} s (--loader-timeout){where}")
