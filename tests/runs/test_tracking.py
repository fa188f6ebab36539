"""--tracking against a real MLflow tracking server (tests/support/mlflowserver.py) and W&B in offline
mode: the config as parameters, each epoch's numbers at step = samples seen, the doctor's verdict, the
best checkpoint as an artifact; a run stopped and resumed is one tracking run with one history; a
server that goes away mid-run does not stop training, and the end says what was not sent."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import wandbfile
from support.mlflowserver import MlflowServer, mlflow_server
from support.planted import planted_slowness
from support.runs import small_config

from raywds.config import TrainConfig
from raywds.errors import ConfigError
from raywds.runs import files

RAYWDS = [sys.executable, "-m", "raywds"]


def train(cfg: TrainConfig, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from raywds.launch.local import run_local

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    run_local(cfg)


@pytest.mark.slow
def test_a_run_stopped_and_resumed_is_one_mlflow_run_with_one_history(
    mlflow_server: MlflowServer, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, experiment = mlflow_server, "stopped-and-resumed"
    run = tmp_path / "run"
    cfg = small_config(
        shards, epochs=3, max_steps=10, tracking=["mlflow"], tracking_checkpoint=True, out=str(run), mode="split"
    )
    train(cfg, server.env(experiment), monkeypatch)  # 8 steps an epoch: stopped inside epoch 2
    [first] = server.runs(experiment)
    assert json.loads((run / files.TRACKING).read_text()) == {"mlflow": first.info.run_id}
    train(dataclasses.replace(cfg, max_steps=None, resume=str(run)), server.env(experiment), monkeypatch)

    [only] = server.runs(experiment)
    assert only.info.run_id == first.info.run_id and only.info.status == "FINISHED"
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(only.data.params) == fields, "every config field is a parameter"
    assert only.data.params["batch_size"] == "16" and only.data.tags["resumed.max_steps"] == "null"
    client = server.client()
    seen = [(m.step, m.value) for m in client.get_metric_history(only.info.run_id, "samples_seen")]
    epochs = [json.loads(line) for line in (run / files.METRICS).read_text().splitlines()]
    rows = [r for r in epochs if r["kind"] in ("epoch", "checkpoint")]
    assert seen == [(r["samples_seen"], float(r["samples_seen"])) for r in rows], "one history, in order"
    assert [m.step for m in client.get_metric_history(only.info.run_id, "val_top1")] == [120, 240, 360]
    top1 = [r["val_top1"] for r in rows if "val_top1" in r]
    assert [m.value for m in client.get_metric_history(only.info.run_id, "val_top1")] == pytest.approx(top1)
    assert only.data.tags["doctor"].startswith("epoch 3: ")
    assert [a.path for a in client.list_artifacts(only.info.run_id, "best")] == ["best/checkpoint.pt"]


@pytest.mark.slow
def test_a_server_gone_mid_run_does_not_stop_training_and_the_end_says_what_was_not_sent(
    shards: Path, tmp_path: Path
) -> None:
    with mlflow_server(tmp_path / "mlflow") as gone:
        run = tmp_path / "run"
        args = [*RAYWDS, "train", "--data", str(shards), "--recipe", "demo", "--epochs", "2", "--batch-size", "16"]
        args += ["--out", str(run), "--tracking", "mlflow", "--loader-workers", "1"]
        env = {**os.environ, **gone.env("gone"), **planted_slowness.environment(0.05), "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(process.stdout or []), daemon=True)
        reader.start()
        deadline = time.monotonic() + 180
        while not any(line.startswith("epoch 1/2") for line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        gone.stop()
        code = process.wait(300)
        reader.join(10)
    output = "".join(lines)
    assert code == 0, output[-3000:]
    assert "epochs 2  top-1" in output, "every epoch trained"
    assert "tracking: mlflow: " in output and "updates were not sent" in output, output[-2000:]
    assert "metrics.jsonl in the run folder holds every number" in output
    rows = [json.loads(line) for line in (run / files.METRICS).read_text().splitlines()]
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == [1, 2]


def test_a_missing_client_and_an_unknown_tracker_are_one_line(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tracking='neptune' is not one of mlflow, wandb, tensorboard"):
        small_config(shards, tracking=["neptune"])
    hidden = tmp_path / "hide" / "wandb"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    out = subprocess.run(
        [*RAYWDS, "train", "--data", str(shards), "--tracking", "wandb", "--out", str(tmp_path / "r"), "--epochs", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(hidden.parent)},
    )
    assert out.returncode == 1, out.stdout[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "raywds: error: --tracking wandb needs the wandb package, which does not import here "
        "(No module named 'wandb'): pip install 'raywds[wandb]'"
    )
    assert not (tmp_path / "r" / files.METRICS).read_text(), "refused before any training"


def test_wandb_offline_holds_the_same_numbers_and_a_resume_reuses_the_run(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "raywds-tests", "WANDB_SILENT": "true"}
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # wandb-core's logs: not in ~/.cache
        env[name] = str(tmp_path / name.lower())
    cfg = small_config(shards, epochs=2, max_steps=10, tracking=["wandb"], out=str(run), mode="split")
    train(cfg, env, monkeypatch)
    run_id = json.loads((run / files.TRACKING).read_text())["wandb"]
    train(dataclasses.replace(cfg, max_steps=None, resume=str(run)), env, monkeypatch)
    assert json.loads((run / files.TRACKING).read_text()) == {"wandb": run_id}
    offline = sorted((run / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 2, f"one folder per process, of the same run id: {offline}"
    history = wandbfile.history(offline)
    rows = [json.loads(line) for line in (run / files.METRICS).read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    logged = [h for h in history if "train_loss" in h]
    assert [(h["samples_seen"], h["train_loss"]) for h in logged] == [
        (r["samples_seen"], pytest.approx(r["train_loss"])) for r in epochs
    ]


def test_tracking_tensorboard_is_the_tensorboard_flag(shards: Path, tmp_path: Path) -> None:
    from raywds.runs.folder import RunDir

    assert small_config(shards, tracking=["tensorboard"]).trackers() == ["tensorboard"]
    assert small_config(shards, tensorboard=True, tracking=["mlflow"]).trackers() == ["mlflow", "tensorboard"]
    assert small_config(shards, tensorboard=True, tracking=["tensorboard"]).trackers() == ["tensorboard"]
    run = RunDir(tmp_path / "run")
    run.open_tracking(["tensorboard"], {}, None)
    assert run.events is not None and run.trackers is None, "TensorBoard writes files itself, no thread"
    run.close()
    assert list((tmp_path / "run" / files.TENSORBOARD).glob("events.out.tfevents.*"))
