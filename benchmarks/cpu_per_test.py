"""CPU seconds of each test, with everything it started: a pytest plugin for the suite's own costs.

    PYTHONPATH=benchmarks ./run-tests -p cpu_per_test               # OUT: /tmp/cpu-per-test
    RAYWDS_CPU_PER_TEST=DIR PYTHONPATH=benchmarks bash .ci/run      # with PYTEST_ADDOPTS="-p cpu_per_test"
    .venv/bin/python benchmarks/cpu_per_test.py DIR                 # the table, by file and by test

Each pytest process that runs tests (each xdist worker) moves itself into a control group of its
own, so every process it starts from then on (ranks, loader workers, a Ray cluster it starts with
`ray start` or `ray.init`, chromium, debootstrap) is counted with it, wherever in the process tree
it ends up. Before and after each test it reads the group's CPU time, the CPU time of Docker's
containers (their own group; the whole machine's, not this worker's), and the machine's busy CPU
(/proc/stat), and appends a line to DIR/<worker>.tsv: test id, wall s, the group's CPU s, the
containers' CPU s, the machine's CPU s. A test's wall time beside its CPU time says what wall time
alone cannot on a machine the tests share: whether a long test waits (a turn, a sleep, a timeout)
or works, and how much of both cores it takes.

Root and cgroup v1's `cpuacct` (/sys/fs/cgroup/cpuacct) or cgroup v2 (/sys/fs/cgroup/cpu.stat);
elsewhere it records nothing and says so once. The groups are left empty and removed at the end.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

V1 = Path("/sys/fs/cgroup/cpuacct")
V2 = Path("/sys/fs/cgroup")
OUT = Path(os.environ.get("RAYWDS_CPU_PER_TEST", "/tmp/cpu-per-test"))
_group: Path | None = None


def usage_s(group: Path) -> float:
    """A control group's CPU seconds so far (0 where it does not exist)."""
    try:
        if (group / "cpuacct.usage").exists():
            return int((group / "cpuacct.usage").read_text()) / 1e9
        for line in (group / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return 0.0


def machine_s() -> float:
    """Busy CPU seconds of the whole machine (all but idle and iowait), from /proc/stat."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def pytest_configure(config: pytest.Config) -> None:
    global _group
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None and getattr(config.option, "numprocesses", None):
        return  # xdist's controller runs no tests
    root = V1 if (V1 / "cpuacct.usage").exists() else V2 if (V2 / "cgroup.controllers").exists() else None
    group = root / f"raywds-test-{worker or 'main'}-{os.getpid()}" if root else None
    try:
        assert group is not None
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except (AssertionError, OSError) as err:
        print(f"cpu_per_test: no control group of its own ({err or 'no cgroup v1 cpuacct or v2'})", file=sys.stderr)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    _group = group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if _group is None:
        yield
        return
    containers = _group.parent / "docker"
    before = (time.monotonic(), usage_s(_group), usage_s(containers), machine_s())
    yield
    after = (time.monotonic(), usage_s(_group), usage_s(containers), machine_s())
    spent = "\t".join(f"{b - a:.1f}" for a, b in zip(before, after))
    with open(OUT / f"{_group.name}.tsv", "a") as out:
        out.write(f"{item.nodeid}\t{spent}\n")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The group goes at once: its processes, this one and any a test left ending, back to the
    parent first (the counting is over). Not after a wait: xdist's controller may end a worker
    before any wait is over, and the group would stay, holding the next run's name."""
    if _group is None:
        return
    for pid in (_group / "cgroup.procs").read_text().split():  # this process among them
        try:
            (_group.parent / "cgroup.procs").write_text(pid)
        except OSError:
            pass  # ended meanwhile
    try:
        _group.rmdir()
    except OSError as err:
        print(f"cpu_per_test: {_group} stays ({err}); rmdir it once its processes end", file=sys.stderr)


def main() -> None:
    """The files' tests by CPU seconds, per file and the 30 costliest tests, and each worker's sums."""
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else OUT)
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    rows = []
    for tsv in sorted(folder.glob("*.tsv")):
        wall = cpu = 0.0
        for line in tsv.read_text().splitlines():
            test, *numbers = line.split("\t")
            w, c, d, m = map(float, numbers)
            rows.append((c, w, d, m, test))
            by_file[test.split("::")[0]][0] += w
            by_file[test.split("::")[0]][1] += c
            by_file[test.split("::")[0]][2] += d
            wall, cpu = wall + w, cpu + c
        print(f"{tsv.stem}: {wall:.0f} s of tests, {cpu:.0f} CPU s in its group")
    print(f"\n{'CPU s':>7} {'wall s':>7} {'containers':>10}  file")
    for file, (w, c, d) in sorted(by_file.items(), key=lambda kv: -kv[1][1]):
        print(f"{c:7.0f} {w:7.0f} {d:10.0f}  {file}")
    print(f"\n{'CPU s':>7} {'wall s':>7} {'machine':>8}  test")
    for c, w, _, m, test in sorted(rows, reverse=True)[:30]:
        print(f"{c:7.1f} {w:7.1f} {m:8.1f}  {test}")


if __name__ == "__main__":
    main()
