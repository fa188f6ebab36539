"""How a rank starts its loader workers: by fork, or from a fork server that has imported, once,
what each worker would otherwise import again.

    context = start_method(workers, world)   # "fork", "forkserver" or None (no workers)
"""

from __future__ import annotations

import multiprocessing
import sys
import types

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
    is forked."""
    methods = multiprocessing.get_all_start_methods()
    if not workers:
        return None
    if world.distributed and "forkserver" in methods:
        multiprocessing.set_forkserver_preload([LOADER, *main_imports()])
        return "forkserver"
    return "fork" if "fork" in methods else None


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
