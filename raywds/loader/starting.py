"""How a rank starts its loader workers: by fork, or from a fork server that has imported, once,
what each worker would otherwise import again; deaf to the signals the rank handles.

    context = start_method(workers, world)   # "fork", "forkserver" or None (no workers)
    quiet = handled()                        # in the rank: SIGTERM and SIGINT, where it handles them
    with held(quiet):                        # around the start; each worker's init: deaf(quiet, id)
        ...
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
import types
from collections.abc import Iterator

from raywds.world import World

LOADER = "raywds.loader.loader"


def start_method(workers: int, world: World) -> str | None:
    """How a rank starts its loader workers (once a run: raywds.loader.pool keeps them).
    By fork where the OS has it: a process that was itself spawned would otherwise spawn its
    workers too and re-import torch in each, seconds per epoch. But a distributed rank runs
    torch.distributed's threads, and a fork copies any lock one of them holds into the worker,
    which can then hang before its first line, leaving its rank waiting for data for ever. So a
    distributed rank starts its workers from a fork server: one clean process per rank that
    imports the loader and the script's own imports once (main_imports), from which each worker
    is forked. So does a process connected to Ray (a Ray Train worker, a Ray task, a driver that
    evaluates in-process): a fork copies the locks of Ray's own threads too, and a worker forked
    from a Ray driver hung before its first shard, or left the driver's next call to Ray waiting for
    ever."""
    methods = multiprocessing.get_all_start_methods()
    if not workers:
        return None
    if (world.distributed or on_ray()) and "forkserver" in methods:
        multiprocessing.set_forkserver_preload([LOADER, *main_imports()])
        return "forkserver"
    return "fork" if "fork" in methods else None


def on_ray() -> bool:
    """Whether this process is connected to Ray (without importing Ray where nothing did)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def main_imports() -> list[str]:
    """The modules the main script imported, by name: what a fork server imports before it forks.

    A worker forked from a fork server runs the user's script again as its own main module
    (`multiprocessing.spawn` does, to find what the script defines), so every import at the
    script's top (Lightning, say: seconds of CPU) is paid again in every worker, every epoch,
    unless the server has it already. Asking the server to preload `__main__` itself does not
    do it before Python 3.14: the server is never told the script's path."""
    main = sys.modules.get("__main__")
    names = set()
    for value in vars(main).values() if main is not None else ():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name in sys.modules and name not in ("__main__", "__mp_main__", "builtins"):
            names.add(name)
    return sorted(names)


QUIET = (signal.SIGTERM, signal.SIGINT)
"""The signals that go to every process of a run: `kill -- -PGID`, `timeout`, systemd's stop and
Ctrl-C (SIGINT to the terminal's foreground process group) to a process group, Slurm's scancel to
every process of a job step."""


def handled() -> tuple[int, ...]:
    """Of QUIET, the signals this process handles: a run's notice (raywds.train.notice), the CLI's
    stop, Python's KeyboardInterrupt, Ray's own handler in a Ray worker."""
    return tuple(int(s) for s in QUIET if signal.getsignal(s) not in (signal.SIG_DFL, signal.SIG_IGN, None))


@contextlib.contextmanager
def held(signals: tuple[int, ...]) -> Iterator[None]:
    """`signals` held (blocked) in this thread while it starts workers: a worker forked now starts
    with them held, as does one forked by a fork server started now (the server holds them for
    its life, which ends with this process's)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signals) if signals else None
    try:
        yield
    finally:
        if before is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def deaf(signals: tuple[int, ...], worker_id: int) -> None:
    """A worker's first line (its DataLoader's worker_init_fn): it ignores the signals its rank
    handles. When they go to every process of the run the rank gets them too, and acts on them
    (a notice's checkpoint, the CLI's one line); a worker that died of them would fail the rank's
    epoch first. The rank ends its workers (raywds.loader.pool); one whose rank is gone ends by
    itself. What was held since the fork (`held`) and is now ignored is dropped."""
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, QUIET)
