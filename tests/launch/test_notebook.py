"""notebooks/ray-demo.ipynb runs headless from top to bottom and shows its plot."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from raycluster import write_token

ROOT = Path(__file__).resolve().parents[2]


def test_the_ray_notebook_runs_and_draws_its_plot(
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
    NotebookClient(
        nb, timeout=400, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "training on: 2 CPU (gloo) workers" in text and "top-1" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is shown inline"
    assert any("<table>" in o.get("data", {}).get("text/html", "") for o in outputs), "the metrics table is shown"
    assert list((tmp_path / "runs" / "ray").glob("nb-*/report.png"))
