"""A real multi-node Ray cluster on one machine: each node in its own network namespace, the
namespaces joined by one veth pair (10.231.0.0/24, a private link: no traffic leaves it), each
node with its own raylet, Ray temp dir and ports, the whole cluster on one token of its own.

    with two_nodes("rwm-") as cluster:
        cluster.run(["raywds", "ray", "--address", cluster.gcs_address, ...])   # a driver on the head
        cluster.lose_worker()        # SIGKILL every process in the worker node's namespace
        cluster.start_worker()       # the node joins again

Needs root and iproute2's `ip`. Torn down by the PIDs it started and the namespaces it made, also
when a test fails. The file system is shared: the nodes see the same /tmp (as nodes see an NFS
mount), except the paths given as `worker_private`, which the worker node sees as empty tmpfs mounts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from support.raycluster import (
    NODE_FLAGS,
    RAY,
    HeadNode,
    cluster_processes,
    head_node,
    ray_temp_dir,
    session_logs,
    stop_cluster,
)
from support.runs import SUMMARY  # re-exported: the two-node tests parse the summary line `raywds ray` ends with

HEAD_IP, WORKER_IP = "10.231.0.1", "10.231.0.2"

HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
"""The GCS checks each node every second and takes it for dead after 3 failed checks in a row
(Ray's defaults: every 3 s, 5 failures), so a lost node is noticed about 3 s after it dies rather
than about 15: each of the tests that lose one waited that long, and what raywds does after is the
same. Each check still waits Ray's 10 s for an answer, so a node slow to answer on a busy machine
is not taken for dead."""


def available() -> str | None:
    """Why two namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    return None


def require() -> None:
    """Skip the calling test where two namespaces cannot be made; fail it instead under
    RAYWDS_REQUIRE_MULTINODE (set by .ci/run), where the multi-node tests must run."""
    import pytest

    why = available()
    if why is not None:
        if os.environ.get("RAYWDS_REQUIRE_MULTINODE"):
            pytest.fail(f"the multi-node tests cannot run here: {why}")
        pytest.skip(why)


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` exited {out.returncode}: {out.stderr.strip()}")


def namespace_pids(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    return [int(p) for p in out.stdout.split()]


def kill_namespace(namespace: str) -> int:
    """SIGKILL every process in `namespace` (a node lost at once, as when its machine dies); the count."""
    pids = namespace_pids(namespace)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while namespace_pids(namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(pids)


@contextmanager
def veth_pair(tag: str) -> Iterator[tuple[str, str]]:
    """Two new network namespaces, `tag`a (10.231.0.1) and `tag`b (10.231.0.2), joined by a veth pair,
    each with `lo` up and a default route over the veth (else Ray cannot find a node's own address).
    On exit, every process left in them is killed and both are deleted."""
    names = (f"{tag}a", f"{tag}b")
    made: list[str] = []
    etc = [Path("/etc/netns") / name for name in names]
    try:
        # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts: the nodes know each other by
        # name, as machines on a LAN do (else c10d warns it cannot name a peer's address).
        # c10d looks up a peer by its IPv4-mapped IPv6 address (::ffff:10.231.0.2), which glibc's
        # hosts file matches only as written.
        named = [(HEAD_IP, names[0]), (WORKER_IP, names[1])]
        hosts = Path("/etc/hosts").read_text() + "".join(f"{ip} {n}\n::ffff:{ip} {n}\n" for ip, n in named)
        for directory in etc:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts").write_text(hosts)
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for name, end, address in ((names[0], f"{tag}va", HEAD_IP), (names[1], f"{tag}vb", WORKER_IP)):
            _ip("link", "set", end, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", end)
            _ip("-n", name, "link", "set", end, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "route", "add", "default", "dev", end)
        yield names
    finally:
        for name in made:
            kill_namespace(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        for directory in etc:
            shutil.rmtree(directory, ignore_errors=True)


def in_namespace(namespace: str, *, private_mounts: Sequence[str] = ()) -> list[str]:
    """The prefix that runs a command in `namespace`; with `private_mounts`, also in a mount namespace
    of its own where each of those paths is an empty tmpfs (a node that cannot see them)."""
    prefix = ["ip", "netns", "exec", namespace]
    if not private_mounts:
        return prefix
    mounts = " && ".join(f"mount -t tmpfs tmpfs {path!s}" for path in private_mounts)
    return [*prefix, "unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh"]


@dataclasses.dataclass
class TwoNodes:
    head: HeadNode
    namespaces: tuple[str, str]
    worker_temp: Path
    token_path: Path
    env: dict[str, str]
    worker_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Set on the worker node's Ray only (its raylet, and so every process it starts there)."""
    worker_private: tuple[str, ...] = ()
    """Paths the worker node cannot see: each an empty tmpfs of its own there (`in_namespace`)."""
    worker_env_set: bool = False
    """Whether the worker node's Ray now runs with `worker_env` (its last `start_worker`)."""
    worker_running: bool = False
    """Whether the worker node was started and not lost since."""

    @property
    def gcs_address(self) -> str:
        return self.head.gcs_address

    def on_head(self, args: Sequence[str]) -> list[str]:
        return [*in_namespace(self.namespaces[0]), *args]

    def run(
        self, args: Sequence[str], *, timeout: float = 300, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`args` on the head node with the cluster's token (a driver, `ray job submit`, `ray list`)."""
        return subprocess.run(
            self.on_head(args), capture_output=True, text=True, timeout=timeout, env={**self.env, **(env or {})}
        )

    def popen(
        self, args: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(self.on_head(args), text=True, env={**self.env, **(env or {})}, **kwargs)  # type: ignore[call-overload]

    def start_worker(self, *, num_cpus: int = 1, with_worker_env: bool = True) -> None:
        """`ray start --address` on the worker node, its temp dir its own, `worker_private` hidden
        from it, with `worker_env` unless not `with_worker_env`; waits until it is alive."""
        args = [
            *in_namespace(self.namespaces[1], private_mounts=self.worker_private),
            str(RAY),
            "start",
            "--address",
            self.gcs_address,
            "--node-ip-address",
            WORKER_IP,
            "--temp-dir",
            str(self.worker_temp),
            "--num-cpus",
            str(num_cpus),
            *NODE_FLAGS,
        ]
        env = {**self.env, **(self.worker_env if with_worker_env else {})}
        out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
        if out.returncode != 0:
            raise RuntimeError(
                f"`ray start --address` on the worker node exited {out.returncode}:\n{out.stdout[-2000:]}\n"
                f"{out.stderr[-3000:]}\n{session_logs(self.worker_temp)}"
            )
        self.wait_for_nodes(2)
        self.worker_env_set, self.worker_running = with_worker_env, True

    def alive_nodes(self) -> list[str]:
        """The node IPs the GCS counts alive."""
        script = (
            "import json, ray; ray.init(address='auto', logging_level='ERROR'); "
            "print('NODES', json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
        )
        out = self.run([sys.executable, "-c", script], timeout=120, env={"RAY_ADDRESS": self.gcs_address})
        if out.returncode != 0:
            raise RuntimeError(f"could not list the nodes: {out.stderr[-2000:]}")
        line = next(row for row in out.stdout.splitlines() if row.startswith("NODES "))
        return sorted(json.loads(line[6:]))

    def wait_for_nodes(self, count: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while len(nodes := self.alive_nodes()) != count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(nodes)} nodes alive ({nodes}), not {count}, after {timeout_s:.0f} s")
            time.sleep(1)

    def lose_worker(self) -> int:
        """Every process of the worker node killed at once; how many there were."""
        self.worker_running = False
        return kill_namespace(self.namespaces[1])


@contextmanager
def two_nodes(
    prefix: str,
    *,
    head_cpus: int = 1,
    worker_cpus: int = 1,
    head_resources: Mapping[str, float] | None = None,
    env: Mapping[str, str] | None = None,
    worker_env: Mapping[str, str] | None = None,
    worker_private: Sequence[str] = (),
) -> Iterator[TwoNodes]:
    """A head node and a worker node in two namespaces named after this process, each with a Ray
    temp dir of its own, the head with `head_resources` (custom resources) if given, the worker's
    Ray with `worker_env` added and the paths in `worker_private` hidden from it (each an empty
    tmpfs there, also after the node is lost and started again); on exit both nodes' processes
    are stopped by PID and the namespaces deleted."""
    tag = f"rw{os.getpid() % 100000}"
    with ExitStack() as stack:
        namespaces = stack.enter_context(veth_pair(tag))
        head_temp = stack.enter_context(ray_temp_dir(prefix + "h-"))
        worker_temp = stack.enter_context(ray_temp_dir(prefix + "w-"))
        # RAY_DEDUP_LOGS=0: Ray folds lines that differ only in their numbers, from different
        # workers, into one ("[repeated 2x across cluster]"), and the tests read every rank's line.
        base = {**(env or os.environ), "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_DEDUP_LOGS": "0", **HEALTH_CHECKS}
        # Every process of the cluster (and the drivers) gets RAY_ADDRESS: Ray Train's actors that
        # call ray.init(address="auto") would otherwise find every Ray on this machine, not one per
        # machine as on a real cluster, and refuse to choose. The namespace's ports are all free.
        address = f"{HEAD_IP}:6379"
        head = stack.enter_context(
            head_node(
                head_temp,
                env=base,
                node_ip_address=HEAD_IP,
                port=6379,
                num_cpus=head_cpus,
                extra_args=["--resources", json.dumps(dict(head_resources))] if head_resources else (),
                prefix=[*in_namespace(namespaces[0]), "env", f"RAY_ADDRESS={address}"],
            )
        )
        stack.callback(stop_cluster, worker_temp)
        cluster = TwoNodes(
            head,
            namespaces,
            worker_temp,
            head_temp / "auth_token",
            {**head.env, "RAY_ADDRESS": address},
            worker_env or {},
            tuple(str(p) for p in worker_private),
        )
        cluster.start_worker(num_cpus=worker_cpus)
        yield cluster


RAYWDS = Path(sys.executable).parent / "raywds"
RANK = re.compile(r"rank (\d+) of (\d+) on node (\S+) \(pid (\d+)\)")
"""Each rank's start line."""


def raywds_ray(
    cluster: TwoNodes, *args: str, timeout: float = 400, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`raywds ray` run on the head node against the cluster."""
    return cluster.run([str(RAYWDS), "ray", "--address", cluster.gcs_address, *args], timeout=timeout, env=env)


def ranks(output: str) -> list[tuple[int, int, str]]:
    """(rank, world size, node IP) of each rank's start line, in order."""
    return [(int(r), int(n), ip) for r, n, ip, _ in RANK.findall(output)]


__all__ = [
    "HEAD_IP",
    "RANK",
    "RAYWDS",
    "SUMMARY",
    "WORKER_IP",
    "TwoNodes",
    "available",
    "cluster_processes",
    "ranks",
    "raywds_ray",
    "two_nodes",
]
