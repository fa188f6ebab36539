"""notebooks/ray-demo.ipynb runs headless (nbclient) up to its last cell, shows its progress bar, table
and plot, and stopping its kernel stops the shard server and the Ray cluster it started. The notebook
in Jupyter Lab, all cells and the page as a user sees it: tests/launch/test_lab.py."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from support.raycluster import cluster_processes, describe, worker_roles, write_token

ROOT = Path(__file__).resolve().parents[2]
WIDGET = "application/vnd.jupyter.widget-view+json"


def refuses(url: str) -> bool:
    host, port = re.fullmatch(r"http://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return False
    except OSError:
        return True


def test_the_ray_notebook_draws_its_plot_and_its_kernel_stops_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_temp: Path
) -> None:
    monkeypatch.setenv("RAYWDS_NOTEBOOK_EPOCHS", "1")
    monkeypatch.setenv("RAYWDS_NOTEBOOK_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a private cluster, never one a user started
    monkeypatch.setenv("RAY_TMPDIR", str(ray_temp))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # with a token of its own: else ray.init writes ~/.ray/auth_token
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(write_token(ray_temp)))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)  # it would win over the file
    nb = nbformat.read(ROOT / "notebooks" / "ray-demo.ipynb", as_version=4)
    *cells, last = nb.cells
    assert "server.stop()" in last.source and "ray.shutdown()" in last.source
    client = NotebookClient(
        nb, timeout=400, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    )
    with client.setup_kernel():  # on exit the kernel is asked to shut down, as Jupyter does
        for index, cell in enumerate(cells):  # not the last: the kernel's stop must do its work
            client.execute_cell(cell, index)
    outputs = [o for cell in cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "training on: 2 CPU (gloo) workers" in text and "top-1" in text
    assert any(WIDGET in o.get("data", {}) for o in outputs), "the progress bar is shown"
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is shown inline"
    assert any("<table>" in o.get("data", {}).get("text/html", "") for o in outputs), "the metrics table is shown"
    assert list((tmp_path / "runs" / "ray").glob("nb-*/report.png"))
    url = re.search(r"^\w+ (http://\S+)$", text, re.M)
    assert url, f"no `backend url` line in\n{text}"
    deadline = time.monotonic() + 30
    while (not refuses(url[1]) or cluster_processes(ray_temp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert refuses(url[1]), f"the shard server at {url[1]} outlived the kernel"
    left = cluster_processes(ray_temp)
    assert not left, f"the notebook's Ray cluster outlived the kernel:\n{describe(left.values())}"
    # The cluster was the notebook's own: no preemption watcher (no autoscaler drains its node) and no
    # idle workers prestarted (none could serve a run whose every process has raywds's runtime env).
    roles = worker_roles(ray_temp)
    assert {"TrainController", "RayTrainWorker", "_AutoscalingCoordinatorActor"} <= set(roles), roles
    assert "PreemptionWatcher" not in roles and "" not in roles, roles
