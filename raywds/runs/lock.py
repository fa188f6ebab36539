"""One run per run folder: a run holds an exclusive lock on RUN_DIR/.raywds-lock while it
writes there (metrics, checkpoints, best/), and a second run into the same folder is refused,
naming the process that holds it. The lock is `fcntl.flock`'s, so it goes when its process does,
however it ends; the file keeps the holder's PID and host to name it. A file still naming a
holder whose lock is gone (a process killed) is taken over with a warning.

A run is refused (bad data, a flag, the model, the resume checkpoint) after it takes the lock and
before it `start()`s; leaving `with` on such an error puts the file back as it was found (removed
where the lock made it), so that a refused run leaves an existing folder byte for byte as it was.

    with RunLock(cfg.out) as lock:
        ...                   # every check that can refuse the run
        lock.start()          # the run folder's first write (raywds.runs.folder.RunDir.start)
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
    """Holds the run folder `path` (made if missing) from `acquire()` (or entering `with`) until
    `release()`; `start()` says that the run has begun."""

    def __init__(self, path: str | Path):
        self.folder = Path(path)
        self.file = self.folder / files.LOCK
        self.started = False
        """Whether the run has begun; until then an error leaving `with` puts the file back as found."""
        self._handle: IO[bytes] | None = None
        self._found: bytes | None = None
        """The file's bytes when the lock was taken (None: the lock made the file)."""
        self._locked = False
        """False on a file system without locks."""

    def acquire(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            opened = self._open()
            if opened is None:  # removed between a look and an open: look again
                continue
            handle, made = opened
            self._locked = self._lock(handle)
            if not self._locked or _is_there(handle, self.file):
                break
            handle.close()  # a refused run removed the file it had made: lock the one there now
        found = handle.read()
        if found.strip():  # its holder ended without releasing it: killed, or its machine lost
            holder = found.decode(errors="replace").strip()
            log.warning("run folder %s: taking over the lock of %s, which is gone", self.folder, holder)
        _write(handle, f"process {os.getpid()} on {socket.gethostname()}\n".encode())
        self._handle, self._found = handle, None if made else found
        _held.add(self)
        return self

    def _open(self) -> tuple[IO[bytes], bool] | None:
        """The lock file, open to read and write, and whether this call made it (None: it went)."""
        try:
            return os.fdopen(os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), "r+b"), True
        except FileExistsError:
            pass
        try:
            return os.fdopen(os.open(self.file, os.O_RDWR), "r+b"), False
        except FileNotFoundError:
            return None

    def _lock(self, handle: IO[bytes]) -> bool:
        """Take the lock on `handle`'s file: True, or False on a file system without locks;
        StorageError, naming the holder, where another process holds it."""
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP):  # a network file system without locks
                log.warning("run folder %s cannot be locked (%s): a second run into it is not refused", self.folder, e)
                return False
            holder = handle.read().decode(errors="replace").strip() or "another process"
            handle.close()
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise StorageError(
                    f"run folder {self.folder} is in use by {holder}: wait for that run to end, "
                    "or give this one another --out"
                ) from None
            raise StorageError(f"cannot lock run folder {self.folder}: {e.strerror} ({self.file})") from None

    def start(self) -> None:
        """The run has begun (nothing can refuse it now): from here on the file is the run's, and
        the run's end leaves it empty, however it ends."""
        self.started = True

    def release(self) -> None:
        """Empty the file (a clean end leaves no holder to name), then let the lock go."""
        self._let_go(b"")

    def put_back(self) -> None:
        """Let the lock go as if it had never been taken: the file as it was found, or none where
        the lock made it (a refused run)."""
        self._let_go(self._found)

    def _let_go(self, content: bytes | None) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        if content is None:  # removed while still held; one who opened it meanwhile sees it gone (_is_there)
            self.file.unlink(missing_ok=True)
        else:
            _write(handle, content)
        if self._locked:
            fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if error is not None and not self.started:
            self.put_back()
        else:
            self.release()


def _write(handle: IO[bytes], content: bytes) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(content)
    handle.flush()


def _is_there(handle: IO[bytes], path: Path) -> bool:
    """Whether `handle` is still the file at `path` (not one removed after it was opened)."""
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(handle.fileno())
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)
