"""A Jupyter kernel that started its own Ray cluster stops it first when the kernel is shut down.

ipykernel, asked to shut down or restart, sends SIGTERM (then SIGKILL) to every process of its
process group, which holds the GCS, raylet and dashboard that `ray.init()` started, and only then
exits and runs `atexit`'s `ray.shutdown()`. Between the two, the driver's log and error threads
poll a GCS that is gone, and Ray's loop retries at once: two cores busy until the kernel exits
(5.5 CPU seconds for a kernel that jupyter_client shut down, 29 in the Jupyter Lab test; 1.1 and
0.1 with Ray stopped first: benchmarks/kernel_shutdown.py, tests/launch/test_lab.py).
`ray.shutdown()` first stops those threads, then the cluster's processes.

    stop_ray_with_the_kernel(ray.shutdown)   # in a process that started Ray: no-op outside a kernel
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def running_kernel() -> Any:
    """The ipykernel kernel this process runs, or None (a script, a terminal IPython)."""
    ipython = sys.modules.get("IPython")  # a kernel imported it already; nothing is imported here
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None)


def stop_ray_with_the_kernel(shutdown: Callable[[], None]) -> bool:
    """Call `shutdown` as the kernel starts to shut down, before it signals its processes; whether
    this process runs a kernel. Its `do_shutdown` is the step ipykernel meant for this ("override
    to do things when the frontend shuts down the kernel"); the kernel's own still runs after."""
    kernel = running_kernel()
    if kernel is None:
        return False
    own = kernel.do_shutdown
    if getattr(own, "stops_ray", False):  # connected again in the same kernel
        return True

    @functools.wraps(own)
    def do_shutdown(restart: bool) -> Any:
        try:
            shutdown()
        except Exception:  # the kernel's own shutdown must run all the same
            logger.exception("stopping Ray before the kernel's shutdown failed")
        return own(restart)

    do_shutdown.stops_ray = True  # type: ignore[attr-defined]
    kernel.do_shutdown = do_shutdown
    return True
