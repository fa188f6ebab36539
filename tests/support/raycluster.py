"""Private Ray clusters for the tests: a token of their own, `ray start --head` on its own temp dir and
ports, and a stop that ends that cluster's processes by PID. `ray stop` would end every Ray process on
the machine, a user's cluster included, and Ray's default token lives in the user's ~/.ray/auth_token:
the tests use neither.

    with ray_temp_dir("rwj-") as temp, head_node(temp) as head:   # its token: temp/auth_token
        subprocess.run([RAY, "job", "submit", "--address", head.dashboard_url, ...], env=head.env)

    with ray_temp_dir("rwt-") as temp, ray_token_env(write_token(temp)):
        ray.init(address="local", _temp_dir=str(temp))                # reads that token
        ...
        ray.shutdown()

A cluster's processes are those whose command line names its temp dir, or that hold a file under it
open, and all their descendants. `ray start` daemonizes them (their parent is PID 1), so the temp dir
is what they share: the GCS, raylet, dashboard, monitor and log monitor name it on their command
lines; the Ray client server names only the GCS address, but its stdout and stderr, like every
daemon's and worker's, are files in the session's logs; the dashboard's module processes (and their
forkserver), the raylet's agents and its workers, whose titles Ray rewrites to `ray::...`, descend
from those. Processes in another network namespace (same PID namespace) are found the same way.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from raywds.serve import free_port

RAY = Path(sys.executable).parent / "ray"
AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
NODE_FLAGS = ("--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port", "0")
"""For every `ray start` of the tests: no usage report, and worker ports the OS picks (never another cluster's)."""


def write_token(directory: Path) -> Path:
    """A fresh token in `directory`/auth_token, in the format of Ray's own (`ray get-auth-token
    --generate`: 64 hex digits, no newline), readable by its owner only."""
    path = Path(directory) / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def token_env(token_path: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (os.environ) for a process that starts or joins the cluster of `token_path`: token mode,
    that token file, and no RAY_AUTH_TOKEN (it would win over the file) or RAY_ADDRESS (it could name
    another cluster)."""
    env = dict(os.environ if base is None else base)
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(token_path)
    return env


def _reload_ray_auth() -> None:
    # Ray caches the auth mode (RayConfig) and the token (a C++ singleton) per process.
    if "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # compiled, not in its stub

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def ray_token_env(token_path: Path) -> Iterator[None]:
    """This process's environment as `token_env` makes it, for an in-process `ray.init`, and as it was
    afterwards. A `ray.init` that starts a cluster with RAY_AUTH_MODE unset sets it to `token` in
    os.environ for good, and writes ~/.ray/auth_token when it finds no token."""
    saved = {k: os.environ.get(k) for k in (*AUTH_VARS, "RAY_ADDRESS")}
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    _reload_ray_auth()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _reload_ray_auth()


# --- processes, named by (pid, start time) so that a reused PID is never taken for one of ours ---

Proc = tuple[int, int]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def is_running(proc: Proc) -> bool:
    stat = _stat(proc[0])
    return stat is not None and stat[2] == proc[1] and stat[0] not in "ZXx"


def _names(pid: int, temp_dir: str, pattern: re.Pattern[str]) -> bool:
    try:
        if pattern.search(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")):
            return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target == temp_dir or target.startswith(temp_dir + "/"):
                return True
    except OSError:  # gone, or not ours to read
        pass
    return False


def cluster_processes(temp_dir: Path | str) -> dict[int, Proc]:
    """Every running process of the cluster whose temp dir is `temp_dir` (see the module docstring),
    never this process or its ancestors."""
    real = os.path.realpath(temp_dir)
    pattern = re.compile("|".join(re.escape(t) + r"(?![\w.-])" for t in {str(temp_dir), real}))
    stats = {pid: s for pid in _pids() if (s := _stat(pid)) is not None and s[0] not in "ZXx"}
    spared, pid = set(), os.getpid()
    while pid > 0 and pid not in spared:
        spared.add(pid)
        pid = stats[pid][1] if pid in stats else 0
    found = {pid for pid in stats if pid not in spared and _names(pid, real, pattern)}
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and child not in spared:
                found.add(child)
                todo.append(child)
    return {pid: (pid, stats[pid][2]) for pid in found}


def describe(procs: Iterable[Proc]) -> str:
    """One line per process: its PID and command line."""
    lines = []
    for pid, _ in procs:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "(gone)"
        lines.append(f"  {pid}: {cmd[:200]}")
    return "\n".join(lines)


def _signal(procs: Sequence[Proc], sig: signal.Signals) -> None:
    for proc in procs:
        if is_running(proc):
            try:
                os.kill(proc[0], sig)
            except ProcessLookupError:
                pass


FATAL = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
"""What `ray stop`, `pkill` or `kill` send first: a stopped process holds them pending."""


def pending(proc: Proc) -> set[signal.Signals]:
    """The signals sent to `proc` that it has not taken yet (a stopped process takes them when continued)."""
    try:
        status = Path(f"/proc/{proc[0]}/status").read_text()
    except OSError:
        return set()
    mask = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):  # sent to one thread, or to the process
            mask |= int(line.split()[1], 16)
    return {s for s in signal.Signals if 0 < s.value <= 64 and mask >> (s.value - 1) & 1}


def ended(proc: Proc) -> str | None:
    """Why `proc` has ended or will when it runs again ("gone", "SIGTERM sent"), or None."""
    if not is_running(proc):
        return "gone"
    sent = sorted(s.name for s in pending(proc) & FATAL)
    return f"{', '.join(sent)} sent" if sent else None


def _stopped(proc: Proc) -> bool:
    """Whether `proc` is stopped, or no longer running at all."""
    stat = _stat(proc[0])
    return not is_running(proc) or (stat is not None and stat[0] in "Tt")


@contextmanager
def frozen(temp_dir: Path | str) -> Iterator[dict[int, Proc]]:
    """The processes of the cluster in `temp_dir` stopped (SIGSTOP) inside, so that it costs no CPU
    (an idle head node takes a tenth of a core: its dashboard, agents, GCS and raylet poll);
    continued (SIGCONT) on the way out. Yields them once each has stopped (SIGSTOP takes effect
    when the process is next scheduled, not when kill returns). A process started meanwhile is
    stopped too."""
    procs: dict[int, Proc] = {}
    while new := {pid: p for pid, p in cluster_processes(temp_dir).items() if pid not in procs}:
        _signal(list(new.values()), signal.SIGSTOP)
        procs.update(new)
        deadline = time.monotonic() + 10
        while not all(map(_stopped, new.values())) and time.monotonic() < deadline:
            time.sleep(0.01)
    try:
        yield procs
    finally:
        _signal(list(procs.values()), signal.SIGCONT)


def _wait_gone(procs: Sequence[Proc], timeout_s: float) -> list[Proc]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if is_running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if is_running(p)]
    return left


def _program(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").rsplit("/", 1)[-1]
    except OSError:
        return ""


def stop_cluster(temp_dir: Path | str, grace_s: float = 10.0) -> None:
    """End the processes of the cluster in `temp_dir` in `ray stop`'s order (raylets, then all but the
    GCS, then the GCS, which otherwise waits for them): SIGTERM, then SIGKILL to those left after
    `grace_s`; again for any started meanwhile. AssertionError naming those left, if any."""
    for _ in range(5):
        procs = cluster_processes(temp_dir)
        if not procs:
            return
        first = [p for pid, p in procs.items() if _program(pid) == "raylet"]
        last = [p for pid, p in procs.items() if _program(pid) == "gcs_server"]
        for stage in (first, [p for p in procs.values() if p not in first and p not in last], last):
            _signal(stage, signal.SIGTERM)
            left = _wait_gone(stage, grace_s)
            _signal(left, signal.SIGKILL)
            left = _wait_gone(left, 10.0)
            assert not left, f"processes of the Ray cluster in {temp_dir} outlived SIGKILL:\n{describe(left)}"
    left_over = cluster_processes(temp_dir)
    assert not left_over, f"the Ray cluster in {temp_dir} keeps starting processes:\n{describe(left_over.values())}"


@dataclasses.dataclass(frozen=True)
class HeadNode:
    temp_dir: Path
    """Ray's temp dir for this node; its processes are found by it."""
    env: dict[str, str]
    """The environment for a process that talks to this cluster (ray CLI, ray.init): its token."""
    gcs_address: str
    """host:port, for `ray start --address` on another node or `ray.init(address=...)`."""
    dashboard_url: str
    """http://host:port, for `ray job submit --address`."""

    def processes(self) -> dict[int, Proc]:
        return cluster_processes(self.temp_dir)


@contextmanager
def ray_temp_dir(prefix: str) -> Iterator[Path]:
    """A new dir under /tmp for one cluster's temp dir (short: Ray's socket paths are limited to 107
    bytes); on exit, every process still using it is stopped (stop_cluster) and it is removed.
    Should this process die first (a test run killed, a CI run past its limit), its reaper kills
    them and removes the dir: `ray start` daemonizes a cluster's processes, so nothing else would."""
    temp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    reaper = start_reaper(temp)
    try:
        yield temp
    finally:
        reaper.kill()
        reaper.wait()
        try:
            stop_cluster(temp)
        finally:
            shutil.rmtree(temp, ignore_errors=True)


REAPER = """
import os, sys, time
pid, start = int(sys.argv[1]), sys.argv[2]
def alive():
    try:
        raw = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[19] == start and fields[0] not in "ZXx"
while alive():
    time.sleep(0.5)
sys.path.insert(0, sys.argv[3])
from support.raycluster import reap
reap(os.environ["RAYCLUSTER_REAP"])
"""
"""A reaper's program: it waits for the process that made the temp dir, then reaps the dir (`reap`).
The dir comes in its environment, not on its command line: `cluster_processes` finds a cluster's
processes by their command lines, and the reaper is not one of them."""


def start_reaper(temp_dir: Path) -> subprocess.Popen[bytes]:
    """A process of its own session (a Ctrl-C at the terminal does not reach it) that reaps
    `temp_dir` once this process is gone; kill it once the cluster is stopped the usual way."""
    me = _stat(os.getpid())
    assert me is not None
    tests = str(Path(__file__).resolve().parents[1])
    return subprocess.Popen(
        [sys.executable, "-c", REAPER, str(os.getpid()), str(me[2]), tests],
        env={**os.environ, "RAYCLUSTER_REAP": str(temp_dir)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def reap(temp_dir: Path | str) -> None:
    """SIGKILL every process of the cluster in `temp_dir` (a stopped one too), until none is left
    (a dying raylet's workers may start something), then remove the dir."""
    for _ in range(10):
        procs = list(cluster_processes(temp_dir).values())
        if not procs:
            break
        _signal(procs, signal.SIGKILL)
        _wait_gone(procs, 10.0)
    shutil.rmtree(temp_dir, ignore_errors=True)


@contextmanager
def in_process_ray(prefix: str, *, num_cpus: int = 2) -> Iterator[None]:
    """`ray.init` of a new local cluster in this process, with the runtime env `raywds ray` gives
    its workers: a short private temp dir (Ray's socket paths have a length limit) with a token of
    its own (else ray.init writes ~/.ray/auth_token), never a running cluster; `ray.shutdown` at
    the end, and its processes stopped by PID if that leaves any."""
    import ray

    from raywds.launch.cluster import RUNTIME_ENV

    with ray_temp_dir(prefix) as temp_dir, ray_token_env(write_token(temp_dir)):
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            _temp_dir=str(temp_dir),
            runtime_env=RUNTIME_ENV,
        )
        try:
            yield
        finally:
            ray.shutdown()


def worker_roles(temp_dir: Path) -> list[str]:
    """What each Python worker process of the clusters in `temp_dir` ran, from the lines Ray writes to
    its stdout log as work is assigned: the actor class (`TrainController`), `task:` and the first
    task's name, or "" for a worker that never ran anything (an idle one, prestarted)."""
    roles = []
    for out in Path(temp_dir).rglob("logs/worker-*.out"):
        role = ""
        for line in out.read_text(errors="replace").splitlines()[:5]:
            if line.startswith((":actor_name:", ":task_name:")):
                kind, name = line[1:].split(":", 1)
                role = name if kind == "actor_name" else f"task:{name}"
                break
        roles.append(role)
    return roles


def session_logs(temp_dir: Path, num_lines: int = 20) -> str:
    """The last lines of every non-empty *.err and *.log of the newest session in `temp_dir`."""
    out = []
    logs = Path(temp_dir) / "session_latest" / "logs"
    for f in sorted(f for f in logs.glob("*") if f.suffix in (".err", ".log")):
        lines = f.read_text(errors="replace").splitlines()[-num_lines:]
        if lines:
            out.append(f"--- {f.name}\n" + "\n".join(lines))
    return "\n".join(out) or f"(no logs under {temp_dir}/session_latest/logs)"


@contextmanager
def head_node(
    temp_dir: Path,
    *,
    token_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    node_ip_address: str = "127.0.0.1",
    port: int | None = None,
    num_cpus: int = 2,
    include_dashboard: bool = True,
    extra_args: Sequence[str] = (),
    prefix: Sequence[str] = (),
    start_timeout_s: float = 120.0,
    stop_grace_s: float = 10.0,
) -> Iterator[HeadNode]:
    """`ray start --head` with `temp_dir` as Ray's temp dir, its token (`token_path`, or a new one in
    `temp_dir`), `env` (os.environ) with that token, the GCS on `port` (else a free one), every other
    port free or picked by the OS, and no `--block`. `extra_args` come last, so they win over these;
    `prefix` runs it inside something (`ip netns exec NS`). On exit its processes are stopped by PID
    (stop_cluster); `temp_dir` stays. A failed start raises with `ray start`'s output and the tails
    of the session's logs."""
    temp_dir = Path(temp_dir)
    token_path = token_path or write_token(temp_dir)
    node_env = token_env(token_path, env)

    taken: set[int] = set()

    def free() -> str:
        """A port free on every address here (a new network namespace has them all), and not one
        this start already chose: the OS may hand out the same free port twice in a row."""
        while (chosen := free_port("0.0.0.0")) in taken:
            pass
        taken.add(chosen)
        return str(chosen)

    gcs_port, dashboard_port = str(port) if port else free(), free()
    args = [
        *prefix,
        str(RAY),
        "start",
        "--head",
        "--temp-dir",
        str(temp_dir),
        "--node-ip-address",
        node_ip_address,
        "--port",
        gcs_port,
        "--num-cpus",
        str(num_cpus),
        *NODE_FLAGS,
        "--ray-client-server-port",
        free(),
        "--metrics-export-port",
        free(),  # else 10001 and a fixed port
        "--dashboard-agent-listen-port",
        free(),
        "--dashboard-agent-grpc-port",
        free(),
        "--runtime-env-agent-port",
        free(),
        "--include-dashboard",
        "true" if include_dashboard else "false",
        "--dashboard-host",
        node_ip_address,
        "--dashboard-port",
        dashboard_port,
        *extra_args,
    ]
    try:
        try:
            out = subprocess.run(args, capture_output=True, text=True, timeout=start_timeout_s, env=node_env)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(
                f"`ray start --head` in {temp_dir} took over {start_timeout_s:.0f} s\n{session_logs(temp_dir)}"
            ) from e
        if out.returncode != 0:
            raise RuntimeError(
                f"`ray start --head` in {temp_dir} exited {out.returncode}:\n"
                f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}\n"
                f"{session_logs(temp_dir)}"
            )
        current = temp_dir / "ray_current_cluster"  # the GCS address with the node IP as Ray resolved it
        gcs_address = current.read_text().strip() if current.is_file() else f"{node_ip_address}:{gcs_port}"
        yield HeadNode(temp_dir, node_env, gcs_address, f"http://{node_ip_address}:{dashboard_port}")
    finally:
        stop_cluster(temp_dir, grace_s=stop_grace_s)
