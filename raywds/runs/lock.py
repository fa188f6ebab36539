"""One run per run folder: a run holds an exclusive lock on RUN_DIR/.raywds-lock while it
writes there (metrics, checkpoints, best/), and a second run into the same folder is refused,
naming the process that holds it. The lock is `fcntl.flock`'s, so it goes when its process does,
however it ends; the file keeps the holder's PID and host to name it. A file still naming a
holder whose lock is gone (a process killed) is taken over with a warning.

    with RunLock(cfg.out):
        train(...)
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import weakref
from pathlib import Path
from types import TracebackType
from typing import IO

from raywds.errors import StorageError
from raywds.runs import files

log = logging.getLogger(__name__)

_held: weakref.WeakSet[RunLock] = weakref.WeakSet()
"""The locks this process holds."""


def _let_go_in_child() -> None:
    """In a forked child (a loader worker): close its copies of the held locks' files. The lock
    stays the run's (an flock goes only when every copy of its descriptor is closed), and goes
    when the run's own process does, not when its last worker notices that it has gone."""
    for lock in list(_held):
        if lock._handle is not None:
            lock._handle.close()
            lock._handle = None


os.register_at_fork(after_in_child=_let_go_in_child)


class RunLock:
    """Holds the run folder `path` (made if missing) from `acquire()` (or entering `with`) until `release()`."""

    def __init__(self, path: str | Path):
        self.folder = Path(path)
        self.file = self.folder / files.LOCK
        self._handle: IO[str] | None = None

    def acquire(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        handle = self.file.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise StorageError(
                    f"run folder {self.folder} is in use by {holder}: wait for that run to end, "
                    "or give this one another --out"
                ) from None
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP):  # a network file system without locks
                log.warning("run folder %s cannot be locked (%s): a second run into it is not refused", self.folder, e)
                return self
            raise StorageError(f"cannot lock run folder {self.folder}: {e.strerror} ({self.file})") from None
        handle.seek(0)
        before = handle.read().strip()
        if before:  # its holder ended without releasing it: killed, or its machine lost
            log.warning("run folder %s: taking over the lock of %s, which is gone", self.folder, before)
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self._handle = handle
        _held.add(self)
        return self

    def release(self) -> None:
        """Empty the file (a clean end leaves no holder to name), then let the lock go."""
        if self._handle is None:
            return
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.flush()
        fcntl.flock(self._handle, fcntl.LOCK_UN)
        self._handle.close()
        self._handle = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()
