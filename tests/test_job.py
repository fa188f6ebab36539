"""`ray job submit --working-dir . -- raywds ray ...` against a cluster from `ray start --head`,
on loopback, stopped afterwards."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from raywds.server import free_port

ROOT = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).parent / "ray"


@pytest.fixture
def head() -> Iterator[tuple[str, dict[str, str]]]:
    """A one-node cluster started the way users start one, with its own temp dir and ports."""
    temp = tempfile.mkdtemp(prefix="rwj-", dir="/tmp")
    dashboard = free_port("127.0.0.1")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    env.pop("RAY_ADDRESS", None)
    start = [
        str(RAY), "start", "--head", "--num-cpus", "2", "--node-ip-address", "127.0.0.1", "--temp-dir", temp,
        "--port", str(free_port("127.0.0.1")), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
        "--dashboard-agent-listen-port", str(free_port("127.0.0.1")), "--metrics-export-port", str(free_port("127.0.0.1")),
        "--disable-usage-stats",
    ]  # fmt: skip
    out = subprocess.run(start, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        subprocess.run([str(RAY), "stop", "--force"], capture_output=True, timeout=120, env={**env, "RAY_TMPDIR": temp})
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_the_demo(head: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    address, env = head
    out = subprocess.run(
        [str(RAY), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
         sys.executable, "-m", "raywds.cli", "ray", "--demo", "--epochs", "1", "--demo-dir", str(tmp_path / "demo"),
         "--storage-path", str(tmp_path / "ray"), "--name", "job-test"],
        capture_output=True, text=True, timeout=400, env=env,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert re.search(r"^epochs 1  top-1 ([\d.]+)  top-5 [\d.]+  samples seen 1216  images/s [\d.]+$", out.stdout, re.M), out.stdout[-3000:]
    assert re.search(r"Job '\S+' succeeded", out.stdout + out.stderr)
    assert re.search(r"RayTrainWorker pid=\d+\S* epoch 1/1  loss", out.stdout), "the workers' epoch lines reach the job's output"
    assert "Reporting training result" not in out.stdout + out.stderr, "Ray Train's per-report INFO lines stay out of the console"
    assert (tmp_path / "ray" / "job-test" / "metrics.jsonl").is_file()
