"""The user's stand-in cluster (tests/conftest.py) is stopped while the tests run; its check must still
see a process that a test killed or sent a signal to end. Plain processes named by a temp dir stand
for a cluster's here, as tests/support/raycluster.py finds a cluster's processes by its temp dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
from support import raycluster

BUSY = "while True: pass"
IDLE = "import time\ntime.sleep(300)"


def cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_a_frozen_cluster_spends_no_cpu_and_its_check_sees_a_kill_and_a_pending_sigterm() -> None:
    with raycluster.ray_temp_dir("rwf-") as temp:
        started = [subprocess.Popen([sys.executable, "-c", code, str(temp)]) for code in (BUSY, IDLE, IDLE)]
        busy, termed, killed = (p.pid for p in started)
        time.sleep(0.5)
        with raycluster.frozen(temp) as procs:
            assert set(procs) == {busy, termed, killed}
            spent = cpu_s(busy)
            time.sleep(0.5)
            assert cpu_s(busy) == spent, "a stopped process runs"
            os.kill(termed, signal.SIGTERM)
            os.kill(killed, signal.SIGKILL)
            started[2].wait(10)
            assert raycluster.ended(procs[busy]) is None
            assert raycluster.ended(procs[termed]) == "SIGTERM sent"
            assert raycluster.ended(procs[killed]) == "gone"
        assert started[1].wait(10) == -signal.SIGTERM, "continued, it takes the signal it held"
        time.sleep(0.5)
        assert cpu_s(busy) > spent, "continued, it runs again"


KILLED_WITH_A_CLUSTER = """
import subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from support import raycluster
with raycluster.ray_temp_dir("rwk-") as temp:
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", str(temp)], start_new_session=True)
    with raycluster.frozen(temp):
        print(temp, daemon.pid, flush=True)
        time.sleep(300)
"""


def test_a_test_process_killed_with_a_cluster_running_leaves_no_process_and_no_temp_dir() -> None:
    """`ray start` daemonizes a cluster's processes; a test run killed (SIGKILL, a CI limit) before it
    stopped them left them running for good, and the user's stand-in cluster stopped (SIGSTOP)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    owner = subprocess.Popen([sys.executable, "-c", KILLED_WITH_A_CLUSTER, tests], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    temp, pid = owner.stdout.readline().split()
    daemon = (int(pid), raycluster._stat(int(pid))[2])  # type: ignore[index]
    assert raycluster.is_running(daemon) and os.path.isdir(temp)
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 20
    while (raycluster.is_running(daemon) or os.path.isdir(temp)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not raycluster.is_running(daemon), "the cluster's process outlived the test process that started it"
    assert not os.path.isdir(temp), "its temp dir was left behind"
