"""The Ray cluster as a training run sees it: joining it, how many workers it can hold, its
nodes, where each node finds the run's storage. Each Ray touchpoint is marked `# RAY`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raywds.errors import ConfigError
from raywds.launch import gloo
from raywds.launch.kernel import stop_ray_with_the_kernel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlan:
    """How many Ray Train workers (a range when elastic), whether each holds a GPU, and the CPUs each reserves."""

    num_workers: int
    use_gpu: bool
    cpus_per_worker: float = 1
    min_workers: int | None = None
    """Elastic: Ray Train starts with at least this many and grows to num_workers as nodes come."""

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    @property
    def ray_num_workers(self) -> int | tuple[int, int]:
        """ScalingConfig's num_workers: a count, or (min, max) for an elastic run."""
        return (self.min_workers or 0, self.num_workers) if self.elastic else self.num_workers

    def describe(self) -> str:
        kind = "GPU" if self.use_gpu else "CPU (gloo)"
        count = f"{self.min_workers}..{self.num_workers}" if self.elastic else str(self.num_workers)
        return f"{count} {kind} worker{'s' if self.num_workers != 1 else ''}"


def rank_tasks(
    function: Callable[..., Any], loader_workers: int | str, num_workers: int | None, max_retries: int
) -> tuple[Any, Any]:
    """A job's ranks as Ray tasks without a process group (evaluate, predict): the worker plan the
    cluster holds (`loader_workers`: a number, else every CPU a rank may take) and `function` as a
    task of one rank's resources, spread over the nodes, retried `max_retries` times when its
    worker dies (never on its own exceptions)."""
    workers = loader_workers if isinstance(loader_workers, int) else None
    plan = plan_workers(ray.cluster_resources(), num_workers, loader_workers=workers)  # RAY
    task = ray.remote(function).options(  # RAY
        num_cpus=plan.cpus_per_worker,
        num_gpus=1 if plan.use_gpu else 0,
        max_retries=max_retries,
        retry_exceptions=False,
        scheduling_strategy="SPREAD",
    )
    return plan, task


def plan_workers(
    resources: dict[str, float],
    num_workers: int | tuple[int, int] | None,
    *,
    default_cpu_workers: int = 2,
    loader_workers: int | None = 0,
    plane_task_cpus: float | None = None,
) -> WorkerPlan:
    """One worker per GPU the cluster has, each reserving CPUs for its loader workers (as many
    as the cluster has per GPU; all of them for `loader_workers` None: `auto`); without GPUs,
    `num_workers` CPU workers of one CPU each.
    `num_workers` (MIN, MAX) is elastic: the cluster must hold MIN now; MAX may wait for nodes.
    With the Ray Data plane (`plane_task_cpus`: what one decode task reserves) a worker reserves
    one CPU, and on a cluster without GPUs less where that leaves no room for one decode task.

    Refuses plans the cluster can never place, which would otherwise wait forever."""
    gpus = int(resources.get("GPU", 0))
    cpus = int(resources.get("CPU", 0))
    low, high = num_workers if isinstance(num_workers, tuple) else (num_workers, num_workers)
    elastic = isinstance(num_workers, tuple)
    if low is not None and (low < 1 or (high is not None and high < low)):
        raise ConfigError(f"--num-workers {low}..{high} must be at least 1, the smaller first")
    if gpus > 0:
        wanted = gpus if high is None else high
        need = low if elastic and low is not None else wanted
        if need > gpus:
            raise ConfigError(
                f"--num-workers {need} needs {need} GPUs but the cluster has {gpus}; use --num-workers {gpus} or fewer"
            )
        per_worker = max(1, cpus // gpus) if loader_workers is None else max(1, min(loader_workers + 1, cpus // gpus))
        per_worker = 1 if plane_task_cpus is not None else per_worker
        return WorkerPlan(wanted, True, per_worker, low if elastic else None)
    wanted = default_cpu_workers if high is None else high
    need = low if elastic and low is not None else wanted
    if need > cpus:
        raise ConfigError(
            f"--num-workers {need} needs {need} CPUs but the cluster has {cpus}; "
            f"use --num-workers {max(cpus, 1)} or add nodes"
        )
    per_cpu_worker: float = 1
    if plane_task_cpus is not None and cpus - wanted < plane_task_cpus:  # share: the decode tasks need room too
        per_cpu_worker = round((cpus - plane_task_cpus) / wanted, 3)
        if per_cpu_worker <= 0:
            raise ConfigError(
                f"--data-plane ray needs a CPU for decoding beside the {wanted} training workers, "
                f"but the cluster has {cpus}; add a node or use --data-plane loader"
            )
    return WorkerPlan(wanted, False, per_cpu_worker, low if elastic else None)


def worker_setup() -> None:
    """Run in every Ray worker process as it starts (runtime_env's worker_process_setup_hook):
    gloo listens on the address Ray knows this node by (raywds.launch.gloo); and code in the worker
    that looks its cluster up by RAY_ADDRESS finds this one. Ray Train's PlacementGroupCleaner asks
    the state API without an address, which otherwise scans the machine for clusters and, where
    two run (a `ray start` cluster beside a notebook's local Ray), fails with "Found multiple
    active Ray instances" and stops watching for a controller that dies, whose placement group it
    is there to remove."""
    gloo.listen_on(ray.util.get_node_ip_address())  # RAY
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # RAY


RUNTIME_ENV = {
    "env_vars": {
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # Ray Train's print patch would log every epoch line twice
        # Ray starts its workers at nice 15, so that they yield to its own daemons; but a run's workers
        # are the run (the controller, the ranks, their loader workers, the plane's tasks), and at
        # nice 15 each gets 1/29 of a core's share beside any process at nice 0: on a busy head node a
        # worker group took 200-230 s to start instead of about 10. Ray's job supervisor sets the same.
        "RAY_worker_niceness": "0",
    },
    "worker_process_setup_hook": f"{__name__}.worker_setup",
}


# Lines Ray's workers print that say nothing a user can act on, kept out of the driver's console
# (they stay in the session's log files).
NOISE = re.compile(
    # Ray Train 2.60's controller starts its PreemptionWatcher actor in a way Ray's core logs as an
    # error on every run (ray-project/ray#53727); preemption handling works regardless.
    r"Actor with class name: 'PreemptionWatcher' and ID: '\w+' has constructor arguments in the object store"
    # Its PlacementGroupCleaner asks the state API (the dashboard's) every few seconds whether the
    # controller lives; where the cluster has no dashboard, or it answers late, it says so each time.
    r"|Failed to query Ray Train Controller actor state\. State API may be temporarily unavailable"
)


def _without_noise(handler: Callable[[dict[str, Any]], None], batch: dict[str, Any]) -> None:
    lines = [line for line in batch.get("lines", []) if not NOISE.search(line)]
    if lines:
        handler({**batch, "lines": lines})


def quiet_known_noise() -> None:
    """Filter NOISE out of the worker output Ray copies to this driver's console."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher  # RAY: internal
    except ImportError:  # another Ray: nothing to filter
        return
    for name, handler in list(getattr(dispatcher, "handlers", [])):
        if name == "ray_print_logs" and getattr(handler, "func", None) is not _without_noise:
            dispatcher.remove_handler(name)
            dispatcher.add_handler(name, functools.partial(_without_noise, handler))


LOCAL_CLUSTER_ENV = {"RAY_prestart_worker_first_driver": "0"}
"""Ray settings for a cluster `connect` starts itself. Its raylet would prestart one idle worker
per CPU for the first driver, with an empty runtime env; every process a run needs has raywds's
(RUNTIME_ENV), so none could use them: two Python processes importing Ray, on the CPUs the run's
own actors are starting on, for nothing."""


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` (where not set already), as it was afterwards."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextlib.contextmanager
def signals_kept() -> Iterator[None]:
    """SIGINT held while Ray connects, then SIGINT and SIGTERM handled as before it (under raywds's
    CLI: one line, exit 130 or 143). ray.init takes the driver's SIGTERM: its own handler exits with
    code 15 (taken here for the one from before), its core worker's prints a C++ stack and aborts.
    A KeyboardInterrupt inside ray.init leaves a traceback from Ray's shutdown at exit; a second
    SIGINT while Ray connects stops it there all the same."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        yield
        return
    sigterm, sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    got: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        got.append(signum)
        if len(got) > 1 and callable(sigint):
            sigint(signum, frame)

    if callable(sigint):
        signal.signal(signal.SIGINT, hold)
    try:
        yield
    except SystemExit as e:  # SIGTERM to ray.init's own handler while it starts
        if e.code != signal.SIGTERM or not callable(sigterm):
            raise
        sigterm(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGINT, sigint if sigint is not None else signal.SIG_DFL)
        signal.signal(signal.SIGTERM, sigterm if sigterm is not None else signal.SIG_DFL)
    if got and callable(sigint):
        sigint(signal.SIGINT, None)


def connect(address: str | None, *, training: bool = True) -> None:
    """Join the cluster at `address`, RAY_ADDRESS or a running `ray start`; else start a local one.
    For `training`, Ray Train's autoscaling coordinator starts now, while the caller gets its data ready."""
    if ray.is_initialized():  # a driver that started Ray itself (a notebook's ray.init()): the same filter
        quiet_known_noise()
        return
    answering(address or os.environ.get("RAY_ADDRESS"))
    # A conversion's tasks (not `training`) need none of a run's settings, and without a runtime env
    # of their own they take the idle workers a cluster prestarts (about 1.2 s each otherwise).
    with (
        environ(LOCAL_CLUSTER_ENV if training else {}),
        signals_kept(),
    ):  # read by the processes of a cluster ray.init starts
        try:
            ray.init(address=address, log_to_driver=True, runtime_env=RUNTIME_ENV if training else None)  # RAY
        except ray.exceptions.AuthenticationError as e:  # no token where it was told to look
            raise ConfigError(token_refused(f"Ray cannot start or join a cluster: {e}")) from None
        except ConnectionError as e:  # Ray keeps why in its cause's text (a traceback as a string)
            why = f"{e} {e.__cause__}"
            if "InvalidAuthToken" in why:
                raise ConfigError(token_refused(f"{e}: it refused this process's token")) from None
            raise ConfigError(f"{e}: {NOT_UP}") from None
    quiet_known_noise()
    warn_slow_imports()
    if started_here():
        # Ray Train's PreemptionWatcher (an actor of its own) waits for the autoscaler to drain a
        # node before preempting it; nothing drains the nodes of a cluster this process started.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        stop_ray_with_the_kernel(ray.shutdown)  # in Jupyter: before the kernel signals the cluster's processes
    if training:
        start_autoscaling_coordinator()


NOT_UP = "check --address (or RAY_ADDRESS) and that the cluster is up (`ray status` on its head)"
"""What to do when no cluster answers at the address raywds was given."""
GCS_ADDRESS = re.compile(r"(?P<host>[\w.-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>\d+)")
"""A cluster's address as `ray start` prints it (host:port of its GCS), not `auto`, `local` or `ray://`."""


def answering(address: str | None) -> None:
    """A cluster address where nothing answers is one line at once: ray.init tries it for one to two
    minutes before it says so."""
    match = GCS_ADDRESS.fullmatch(address or "")
    if match is None:
        return
    try:
        socket.create_connection((match["host"].strip("[]"), int(match["port"])), timeout=10).close()
    except OSError as e:
        raise ConfigError(f"no Ray cluster answers at {address} ({e.strerror or e}): {NOT_UP}") from None


def token_refused(said: str) -> str:
    """One line for a token Ray refused or could not find (its own message runs to a paragraph): its
    first sentence, and where the token goes."""
    said = said.split(". ")[0].rstrip(".")
    return (
        f"{said}; give every process the cluster's token "
        "(RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token; `ray get-auth-token --generate` writes one for a new "
        "cluster), see docs/cluster.md"
    )


SLOW_IMPORTS = {"rfc3987_syntax": "rfc3987-syntax"}
"""Modules that make every process Ray starts slower to start, by the package to uninstall."""


def warn_slow_imports() -> None:
    """A warning for each SLOW_IMPORTS module this Python can import: Jupyter installs rfc3987-syntax
    (for jsonschema's `iri` format check), jsonschema imports it in every process Ray starts, and it
    builds a parser as it is imported (docs/ray.md)."""
    for module, package in SLOW_IMPORTS.items():
        if importlib.util.find_spec(module) is not None:
            log.warning(
                f"{package} is installed (Jupyter brings it): each process Ray starts spends ~2 s importing it, "
                f"and a run waits for about ten in a row; `pip uninstall {package}` (nothing here needs it)"
            )


def started_here() -> bool:
    """Whether this process started the cluster it is connected to (no RAY_ADDRESS, no `ray start`)."""
    node = getattr(ray._private.worker, "_global_node", None)  # RAY: internal; the node ray.init started or joined
    return bool(getattr(node, "head", False))


COORDINATOR_START_S = 300.0
"""How long a run waits for Ray Train's autoscaling coordinator to start before it goes on without."""


def start_autoscaling_coordinator() -> Any:
    """Start Ray's autoscaling coordinator (one detached actor per cluster) unless it runs; returns
    a ref that is ready when it is, or None in a Ray without one. Ray Train's controller asks it
    for resources as it starts, with a 5 s timeout that includes the actor's own start, a fresh
    Python process importing Ray Data: on a busy or slow machine that ran late and printed a
    GetTimeoutError traceback ("Failed to send resource request") on every run. Started here,
    it starts while the driver prepares, and `wait_for_coordinator` makes sure it answers."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (  # RAY: internal
            get_or_create_autoscaling_coordinator,
        )
    except ImportError:
        return None
    return get_or_create_autoscaling_coordinator().__ray_ready__.remote()  # RAY


def wait_for_coordinator(ready: Any) -> None:
    """Wait (up to COORDINATOR_START_S) until the coordinator that `ready` came from is up."""
    if ready is not None:
        ray.wait([ready], timeout=COORDINATOR_START_S)  # RAY


def alive_nodes() -> dict[str, str]:
    """Node id -> IP of every node the cluster counts alive."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}  # RAY


def node_count() -> int:
    return len(alive_nodes())


def node_ip() -> str:
    """This node's address as the cluster's other nodes reach it (for a shard server to advertise)."""
    return str(ray.util.get_node_ip_address())  # RAY


def lost_since(before: dict[str, str]) -> list[str]:
    """The IPs of the nodes in `before` that are no longer alive."""
    try:
        now = alive_nodes()
    except Exception:  # noqa: BLE001 - the cluster itself may be gone: say nothing rather than fail twice
        return []
    return sorted(ip for node, ip in before.items() if node not in now)


def split_storage(storage_path: str) -> tuple[str, str | None]:
    """(what Ray Train gets, the local path of it or None): a URI that pyarrow's file systems
    understand (s3://, gs://, file://) passes through untouched; a plain path is made absolute.
    Only a plain path or a file:// URI gives the driver a folder to write into."""
    if "://" in storage_path:
        scheme, rest = storage_path.split("://", 1)
        return storage_path, ("/" + rest.lstrip("/") if scheme == "file" else None)
    path = os.path.abspath(storage_path)
    return path, path


@ray.remote(num_cpus=0)  # RAY: runs beside busy workers
def _sees(path: str) -> bool:
    return os.path.exists(path)


def check_every_node_sees(path: str, what: str) -> None:
    """ConfigError naming each node on which `path` (which the driver just wrote) does not exist:
    a local --storage-path that other nodes cannot see would fail only when a checkpoint is
    written (or, worse, leave each node's checkpoints on its own disk)."""
    nodes = alive_nodes()
    if len(nodes) < 2:
        return
    checks = {
        ip: _sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(path)  # RAY
        for node, ip in nodes.items()
    }
    blind = sorted(ip for ip, seen in checks.items() if not ray.get(seen, timeout=120))  # RAY
    if blind:
        raise ConfigError(
            f"{what} is on this machine only: node(s) {', '.join(blind)} cannot see {path}, "
            "which this machine sees. Give a path that every node mounts (NFS, a shared disk) or a URI "
            "(s3://, gs://, file:// on a shared mount)"
        )
