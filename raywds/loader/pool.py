"""Loader workers that live for the whole run: one process per worker, started once, handed
each epoch's pipeline (its seeds, its shard deal, its resume position) when the epoch begins.

Starting a rank's workers afresh each epoch cost every epoch the workers' start (a fork, or a
fork server's imports), their first shards' reads and their first batches: 26% of an H200's
epoch of 78 steps was the rank waiting for data. A pool keeps its workers; an epoch's pipeline
goes to each worker down a pipe of its own and the worker builds it there, so nothing the
epoch's plan guarantees changes: the same stages, the same slots, the same seeds.

Each worker is a torch DataLoader of one persistent worker process (`Member`), so the pool can
start or stop only the difference when `--loader-workers auto` changes the count between
epochs, and a worker found dead when an epoch begins is replaced alone. The batches of an epoch
come from the workers in turn, skipping those that have finished, as a DataLoader of many
workers hands them over. A worker that dies inside an epoch fails the epoch, as before: what it
had read cannot be told apart from what it had not.

    pool = Pool(world, timeout=cfg.loader_timeout)
    for epoch in range(3):
        for batch in pool.begin(build, workers, on_timeout): ...   # build(blocks) -> the worker's pipeline
    pool.close()
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils import signal_handling

from raywds.loader.blocks import Blocks
from raywds.loader.starting import deaf, handled, held, start_method
from raywds.world import World

Build = Callable[[Blocks], Iterable[Any]]
"""Worker side: an epoch's pipeline over the worker's own reused blocks; its batches come as
(batch, lease) pairs (raywds.loader.blocks.Blocks.leased)."""

_current: tuple[int, int] | None = None
"""In a pool's worker: (its index, the workers of the epoch it is making)."""


def current_worker() -> tuple[int, int] | None:
    """(this loader worker's index, the rank's worker count) in a loader worker, None elsewhere."""
    if _current is not None and get_worker_info() is not None:
        return _current
    info = get_worker_info()
    return None if info is None else (info.id, info.num_workers)


class Relay(IterableDataset[Any]):
    """Worker side, the DataLoader's dataset: each pass (an epoch) runs the pipeline the pool
    sent down `inbox` for it; None ends the worker's last pass."""

    def __init__(self, inbox: Connection, blocks: Blocks):
        self.inbox, self.blocks = inbox, blocks

    def __iter__(self) -> Iterator[Any]:
        global _current
        sent = _wait(self.inbox)
        if sent is None:
            return
        build, index, count = sent
        _current = (index, count)
        yield from build(self.blocks)


PARENT_CHECK_S = 1.0
"""How often a waiting worker looks whether the process that started it is still there."""


def _wait(inbox: Connection) -> Any:
    """The next pipeline down `inbox`, or None once the process that started this worker is gone
    (SIGKILLed, OOM-killed): the pipe would never close, as this worker holds its other end too
    (forked with it), and without the check it would wait for ever. torch's own worker loop
    checks the same way (its ManagerWatchdog) once the pass ends."""
    parent = os.getppid()
    while not inbox.poll(PARENT_CHECK_S):
        if os.getppid() != parent:
            return None
    return inbox.recv()


class Member:
    """One worker of a pool: a DataLoader of one persistent worker process."""

    def __init__(self, index: int, context: str | None, *, pin: bool, timeout: float):
        self.index = index
        self.blocks = Blocks(1)
        self.quiet = handled()
        """The signals this process handles, which its worker ignores (it is ended by this process)."""
        mp = multiprocessing.get_context(context)
        reader, self.inbox = mp.Pipe(duplex=False)
        self.loader = DataLoader(
            Relay(reader, self.blocks),
            batch_size=None,
            num_workers=1,
            persistent_workers=True,
            multiprocessing_context=context,
            pin_memory=pin,
            timeout=timeout,
            worker_init_fn=functools.partial(deaf, self.quiet),
        )
        self.batches: Iterator[Any] | None = None
        self.waiting = False
        """Started (or resumed) and waiting for its pipeline."""

    def start(self) -> None:
        """Start the worker (the first time), or end its last pass (it may not have finished:
        torch drops what it had made); then it waits for a pipeline."""
        if self.waiting:
            return
        first = self.loader._iterator is None  # torch keeps the persistent iterator here
        with held(self.quiet):  # the worker starts with them held, until it ignores them (deaf)
            self.batches = iter(self.loader)
        if first:
            # torch's SIGCHLD handler raises anywhere in the training process when any worker
            # dies, an idle one between epochs included; without it the death is found where
            # the pool looks (`alive`) or where a batch is awaited (torch checks every 5 s).
            signal_handling._remove_worker_pids(id(self.batches))
            self.batches._worker_pids_set = False  # type: ignore[attr-defined]  # nothing for torch to remove
        self.blocks.forget_unwatched()
        self.waiting = True

    def send(self, build: Build, count: int) -> None:
        self.start()
        self.inbox.send((build, self.index, count))
        self.waiting = False

    @property
    def pid(self) -> int | None:
        workers = getattr(self.loader._iterator, "_workers", [])
        return workers[0].pid if workers else None

    def alive(self) -> bool:
        workers = getattr(self.loader._iterator, "_workers", [])
        return all(w.is_alive() for w in workers)

    def close(self) -> None:
        """Stop the worker: a waiting one is told its pass is over, then torch's own shutdown."""
        try:
            if self.waiting:
                self.inbox.send(None)
        except (OSError, ValueError):
            pass
        processes = list(getattr(self.loader._iterator, "_workers", []))
        _shut(self.loader)
        for process in processes:  # stuck: torch's SIGTERM does not end it (deaf), SIGKILL does
            if process.is_alive():
                process.kill()
                process.join(PARENT_CHECK_S)
        self.inbox.close()


def _shut(loader: DataLoader[Any]) -> None:
    iterator = loader._iterator
    if iterator is not None:
        iterator._shutdown_workers()  # type: ignore[attr-defined]  # torch's own clean-up, private
        loader._iterator = None


def _close_all(members: list[Member]) -> None:
    for member in members:
        member.close()
    members.clear()


class Pool:
    """One rank's loader workers, for every epoch of a run (or every validation pass)."""

    def __init__(self, world: World, *, timeout: float):
        self.world, self.timeout = world, timeout
        self.members: list[Member] = []
        self.replaced = 0
        """Workers found dead when an epoch began, and replaced."""
        self._closed = weakref.finalize(self, _close_all, self.members)

    @property
    def pids(self) -> list[int | None]:
        return [m.pid for m in self.members]

    def resize(self, count: int) -> None:
        """`count` workers, started or stopped only by the difference; a dead one is replaced."""
        while len(self.members) > count:
            self.members.pop().close()
        for i, member in enumerate(self.members):
            if not member.alive():
                member.close()
                self.members[i] = self._member(i)
                self.replaced += 1
        context = start_method(count, self.world)
        while len(self.members) < count:
            self.members.append(self._member(len(self.members), context))
        for member in self.members:  # every worker starts before any is waited on
            member.start()

    def _member(self, index: int, context: str | None = None) -> Member:
        context = context or start_method(1, self.world)
        return Member(index, context, pin=self.world.device.startswith("cuda"), timeout=self.timeout)

    def warm(self, count: int) -> None:
        """Start `count` workers now, ahead of the pass that needs them."""
        if count:
            self.resize(count)

    def begin(self, build: Build, count: int, on_timeout: Callable[[int | None], Exception]) -> Iterator[Any]:
        """Hand every worker its pipeline now (they start making batches at once) and return
        the pass's batches; `count` 0 makes them in this process, when iterated."""
        if not count:
            return _inline(build, pin=self.world.device.startswith("cuda"))
        self.resize(count)
        for member in self.members:
            member.send(build, count)
        return self._merged(list(self.members), on_timeout)

    def _merged(self, members: list[Member], on_timeout: Callable[[int | None], Exception]) -> Iterator[Any]:
        """The workers' batches in turn, each leased block watched until it is free."""
        try:
            while members:
                for member in list(members):
                    assert member.batches is not None
                    try:
                        batch, lease = next(member.batches)
                    except StopIteration:
                        members.remove(member)
                        continue
                    except RuntimeError as e:
                        if not str(e).startswith("DataLoader timed out after"):
                            raise
                        for m in self.members:  # stuck: torch would wait 5 s on each
                            if m.pid is not None:
                                _kill(m)
                        raise on_timeout(member.index) from e
                    member.blocks.release()
                    if lease is not None:
                        member.blocks.watch(lease, batch.images)
                    yield batch
        except GeneratorExit:  # the epoch ended before the workers' streams (resample): they stay
            raise
        except BaseException:
            self.close()  # a worker's error, or a stall: the next run starts afresh
            raise

    def close(self) -> None:
        self._closed()


def _kill(member: Member) -> None:
    for process in getattr(member.loader._iterator, "_workers", []):
        process.kill()


def _inline(build: Build, *, pin: bool) -> Iterator[Any]:
    """No workers: the pipeline runs in this process (a DataLoader pins its batches)."""
    loader = DataLoader(_Once(build), batch_size=None, num_workers=0, pin_memory=pin)
    for batch, _lease in loader:
        yield batch


class _Once(IterableDataset[Any]):
    def __init__(self, build: Build):
        self.build = build

    def __iter__(self) -> Iterator[Any]:
        return iter(self.build(Blocks(0)))
