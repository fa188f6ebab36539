"""What Ray costs a training run: the same job under `torchrun --nproc-per-node 2 -m raywds
train` (the baseline) and `raywds ray --num-workers 2` on a fresh local Ray cluster, in turn.

    .venv/bin/python benchmarks/ray_cost.py [--epochs 2] [--repeats 3] [--long-lived] [--bare] [--timeline]
                                            [--two-nodes]

Both run the demo recipe on the demo shards, two CPU ranks over gloo, rank 0 writing a progress
row per step (`--log-every 0`, each row with its wall time). From those rows and the process's
start and end:
  to first step   process start -> rank 0's first step done (imports, cluster, workers, loaders)
  step time       median time between rank 0's consecutive steps, each epoch's first 3 left out
  after last step rank 0's last step -> the process has exited (validation, checkpoint, shutdown)
Ray runs on a private temp dir with a token of its own, and is stopped by its own driver.
--long-lived also runs `raywds ray --address` against one cluster started beforehand with
`ray start --head` (as a user keeps one running between jobs), which leaves the cluster's own
start out of every run. --bare also runs, on each kind of cluster, a Ray Train run that trains
nothing (benchmarks/bare_ray_train.py: plain Ray Train, no raywds; 2 gloo workers pass 8
barriers): the time to its first "step" is Ray Train's own way to a training function, and its
whole run Ray's floor. --timeline prints, for the last run of each Ray kind, every process the
run started: when it first appeared (seconds from the command's start) and the CPU seconds it used.
--two-nodes (root, iproute2) also runs `raywds ray` on the tests' two-node cluster (two network
namespaces on this machine, tests/support/netnodes.py), a rank on each node, started once beforehand as
a user's cluster would be: on one machine that shows the cost of the network path, not speed-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from raywds.data.demo import prepare

BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import raycluster  # noqa: E402  # the tests' private clusters: own temp dir, token and ports; stopped by PID

Timeline = dict[int, tuple[float, float, str]]
"""pid -> (first seen, s after the command's start; CPU s used; command line or Ray's title)."""


def rows(metrics: Path) -> list[dict]:
    return [r for line in metrics.read_text().splitlines() if (r := json.loads(line)).get("kind") == "progress"]


def _cpu_and_title(pid: int) -> tuple[float, str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), cmd


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                raw = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(raw[raw.rindex(")") + 2 :].split()[1]), []).append(int(name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@contextmanager
def sampled(processes: Callable[[], set[int]], start: float, timeline: Timeline, every_s: float = 0.25):
    """Sample `processes()` every `every_s` into `timeline` while the block runs."""
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            for pid in processes():
                now = _cpu_and_title(pid)
                if now is not None:
                    first, _, title = timeline.get(pid, (time.time() - start, 0.0, ""))
                    if not title.startswith("ray::") and now[1]:  # Ray retitles its workers once they start
                        title = now[1]
                    timeline[pid] = (first, now[0], title)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def measure(
    command: list[str], metrics: Path, env: dict[str, str], ray_temp: Path | None = None
) -> tuple[dict[str, float], Timeline]:
    """Run `command`; its times from rank 0's progress rows, and (for a Ray run) the timeline of every
    process it or the cluster in `ray_temp` started meanwhile."""
    start = time.time()
    timeline: Timeline = {}
    before = set(raycluster.cluster_processes(ray_temp)) if ray_temp else set()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def ours() -> set[int]:
        cluster = set(raycluster.cluster_processes(ray_temp)) - before if ray_temp else set()
        return {proc.pid} | _descendants(proc.pid) | cluster

    with sampled(ours if ray_temp else lambda: set(), start, timeline):
        output, _ = proc.communicate(timeout=1200)
    end = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{command[0]} failed:\n{output[-5000:]}")
    progress = rows(metrics)
    gaps = [
        b["time"] - a["time"]
        for a, b in zip(progress, progress[1:])
        if a["epoch"] == b["epoch"] and a["step_in_epoch"] >= 3
    ]
    times = {
        "to_first_step_s": progress[0]["time"] - start,
        "step_s": statistics.median(gaps),
        "after_last_step_s": end - progress[-1]["time"],
        "total_s": end - start,
    }
    return times, timeline


def print_timeline(name: str, timeline: Timeline, to_first_step_s: float) -> None:
    """The processes a run started, by when they appeared; those that used under 0.2 CPU s left out."""
    shown = sorted((t, cpu, cmd) for t, cpu, cmd in timeline.values() if cpu >= 0.2)
    print(f"\n{name}: every process the run started (first step at {to_first_step_s:.1f} s)")
    print(f"{'appeared s':>10} {'CPU s':>7}  process")
    for t, cpu, cmd in shown:
        print(f"{t:10.1f} {cpu:7.1f}  {short(cmd)}")
    before = sum(cpu for t, cpu, _ in shown if t < to_first_step_s)
    print(f"{'':10} {sum(c for _, c, _ in shown):7.1f}  in all, {before:.1f} in processes begun before the first step")


def short(cmd: str) -> str:
    """A process's name: Ray's title (ray::TrainController), else its program and first arguments."""
    if cmd.startswith("ray::") or cmd.startswith("ray-dashboard-"):
        return cmd.split(" (")[0].split()[0]
    words = [w.rsplit("/", 1)[-1] if "/" in w else w for w in cmd.split()[:4]]
    return " ".join(words)[:70]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="keep the demo shards and runs here (default: a temp dir)")
    parser.add_argument("--long-lived", action="store_true", help="also on a cluster started once beforehand")
    parser.add_argument("--bare", action="store_true", help="also a Ray Train run that trains nothing, on each cluster")
    parser.add_argument("--timeline", action="store_true", help="print every process of the last Ray runs")
    parser.add_argument("--two-nodes", action="store_true", help="also on a two-node cluster (root, iproute2)")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="raywds-raycost-"))
    shards = prepare(work / "demo")
    job = ["--recipe", "demo", "--data", str(shards), "--epochs", str(args.epochs), "--log-every", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results: dict[str, list[dict[str, float]]] = {"torchrun": [], "ray": []}
    timelines: dict[str, tuple[Timeline, float]] = {}
    with contextlib.ExitStack() as stack:
        kinds = {"ray": stack.enter_context(fresh_clusters(env))}
        if args.long_lived:
            results["ray, long-lived"] = []
            kinds["ray, long-lived"] = stack.enter_context(long_lived_cluster(env))
        for i in range(args.repeats):  # in turn, so that a busy spell of the machine hits every kind alike
            out = work / f"torchrun-{i}"
            command = [str(BIN / "torchrun"), "--nproc-per-node", "2", "-m", "raywds", "train", *job, "--out", str(out)]
            results["torchrun"].append(measure(command, out / "metrics.jsonl", env)[0])
            for name, cluster in kinds.items():
                storage = work / f"{name.replace(', ', '-')}-{i}"
                command = [str(BIN / "raywds"), "ray", *cluster.address, *job, "--num-workers", "2"]
                command += ["--storage-path", str(storage), "--name", "b"]
                times, timeline = measure(command, storage / "b" / "metrics.jsonl", cluster.env, cluster.temp)
                results[name].append(times)
                timelines[name] = timeline, times["to_first_step_s"]
                if args.bare:
                    bare, out = f"bare {name}", work / f"bare-{name.replace(', ', '-')}-{i}"
                    command = [sys.executable, str(Path(__file__).parent / "bare_ray_train.py"), str(out)]
                    results.setdefault(bare, []).append(
                        measure(command + list(cluster.address[1:]), out / "metrics.jsonl", cluster.env)[0]
                    )
    if args.two_nodes:
        results["ray, 2 nodes"] = two_nodes(job, work, args.repeats, env)
    keys = ("to_first_step_s", "step_s", "after_last_step_s", "total_s")
    print(f"{args.epochs} epochs of the demo recipe, 2 CPU ranks, median of {args.repeats} runs each")
    names = list(results)
    print(f"{'':18}" + "".join(f"{name:>17}" for name in names) + "".join(f"{n + '/torchrun':>26}" for n in names[1:]))
    for key in keys:
        medians = [statistics.median(r[key] for r in runs) for runs in results.values()]
        ratios = "".join(f"{m / medians[0]:25.2f}x" for m in medians[1:])
        print(f"{key:18}" + "".join(f"{m:17.3f}" for m in medians) + ratios)
    if args.two_nodes:
        step = {name: statistics.median(r["step_s"] for r in runs) for name, runs in results.items()}
        print(f"step time, 2 nodes / 1 node under Ray: {step['ray, 2 nodes'] / step['ray']:.2f}x")
    if args.timeline:
        for name, (timeline, first_step) in timelines.items():
            print_timeline(name, timeline, first_step)
    print(json.dumps(results))


@dataclass(frozen=True)
class Cluster:
    env: dict[str, str]
    temp: Path
    address: tuple[str, ...] = ()
    """`raywds ray`'s --address flag, or nothing for a cluster the run starts itself."""


@contextmanager
def fresh_clusters(env: dict[str, str]) -> Iterator[Cluster]:
    """Each run starts (and its driver stops) a local cluster in this temp dir, with a token of its own."""
    with raycluster.ray_temp_dir("rwb-") as temp:  # short: Ray's socket paths are limited
        token = raycluster.write_token(temp)
        yield Cluster({**raycluster.token_env(token, env), "RAY_TMPDIR": str(temp)}, temp)


@contextmanager
def long_lived_cluster(env: dict[str, str]) -> Iterator[Cluster]:
    """One `ray start --head` cluster for every run, as a user keeps one between jobs."""
    with raycluster.ray_temp_dir("rwl-") as temp, raycluster.head_node(temp, env=env) as head:
        yield Cluster(head.env, temp, ("--address", head.gcs_address))


def two_nodes(job: list[str], work: Path, repeats: int, env: dict[str, str]) -> list[dict[str, float]]:
    from support import netnodes  # the tests' two-node cluster

    runs = []
    with netnodes.two_nodes("rwb2-") as cluster:
        for i in range(repeats):
            storage = work / f"ray2-{i}"
            command = [str(BIN / "raywds"), "ray", "--address", cluster.gcs_address, *job]
            command += ["--num-workers", "2", "--storage-path", str(storage), "--name", "b"]
            metrics = storage / "b" / "metrics.jsonl"
            runs.append(measure(cluster.on_head(command), metrics, {**cluster.env, "OMP_NUM_THREADS": "1"})[0])
    return runs


if __name__ == "__main__":
    main()
