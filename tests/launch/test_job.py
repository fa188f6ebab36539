"""`ray job submit --working-dir . -- raywds ray ...` against a cluster from `ray start --head`,
with its own temp dir, ports and token, stopped afterwards by its PIDs (tests/raycluster.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from raycluster import RAY, HeadNode, head_node, ray_temp_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def head(user_cluster: HeadNode) -> Iterator[tuple[str, dict[str, str]]]:
    """A one-node cluster started the way users start one: the dashboard's URL and the environment
    that reaches it (its token)."""
    with ray_temp_dir("rwj-") as temp, head_node(temp, env={**os.environ, "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}) as node:
        yield node.dashboard_url, node.env


def test_ray_job_submit_runs_the_demo(head: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    address, env = head
    out = subprocess.run(
        [
            str(RAY),
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            str(ROOT),
            "--",
            sys.executable,
            "-m",
            "raywds.cli",
            "ray",
            "--demo",
            "--epochs",
            "1",
            "--demo-dir",
            str(tmp_path / "demo"),
            "--storage-path",
            str(tmp_path / "ray"),
            "--name",
            "job-test",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert re.search(
        r"^epochs 1  top-1 ([\d.]+)  top-5 [\d.]+  samples seen 1216  images/s [\d.]+$", out.stdout, re.M
    ), out.stdout[-3000:]
    assert re.search(r"Job '\S+' succeeded", out.stdout + out.stderr)
    assert re.search(r"RayTrainWorker pid=\d+\S* epoch 1/1  loss", out.stdout), (
        "the workers' epoch lines reach the job's output"
    )
    assert "Reporting training result" not in out.stdout + out.stderr, (
        "Ray Train's per-report INFO lines stay out of the console"
    )
    assert (tmp_path / "ray" / "job-test" / "metrics.jsonl").is_file()
    assert "Traceback" not in out.stdout + out.stderr, (
        "no process of the run printed a traceback; with the user's stand-in cluster on this machine too, "
        "Ray Train's PlacementGroupCleaner did when it had to find its cluster by itself:\n"
        + "\n".join(line for line in (out.stdout + out.stderr).splitlines() if "Error" in line)[-3000:]
    )
