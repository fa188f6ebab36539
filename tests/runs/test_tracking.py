"""--tracking against a real MLflow tracking server (tests/support/mlflowserver.py) and W&B in offline
mode: the config as parameters, each epoch's numbers at step = samples seen, the doctor's verdict, the
best checkpoint as an artifact; a run stopped and resumed is one tracking run with one history; a
server that does not answer is refused at once in a line naming it; one that goes away mid-run does
not stop training, the end does not wait for it and says what was not sent, and the MLflow run it
left RUNNING is ended by what continues the run or by the next `raywds report` that reaches it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import wandbfile
from support.gcsserver import free_port
from support.mlflowserver import Gate, MlflowServer, mlflow_server
from support.planted import planted_slowness
from support.runs import small_config

from raywds.errors import ConfigError
from raywds.runs import files
from raywds.runs.report import local_copy
from raywds.runs.tracking import NOT_ENDED, Trackers
from raywds.train.config import TrainConfig

RAYWDS = [sys.executable, "-m", "raywds"]
REFUSED_WITHIN_S = 8.0
"""A generous bound, for a busy 2-core machine, on a check that waits 2 s at most."""


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
    fields = {f"{section}.{name}" for section, names in cfg.to_dict().items() for name in names}
    assert set(only.data.params) == fields and len(fields) == len(dataclasses.fields(TrainConfig)), (
        "each field, by section"
    )
    assert only.data.params["plan.batch_size"] == "16" and only.data.tags["resumed.run.max_steps"] == "null"
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
    """The server killed inside epoch 1: both epochs train; the end does not wait for it (not the
    15 s it gives a server that answers) and says what was not sent, naming the server; the MLflow
    run it left RUNNING is ended, as FINISHED at the time the run ended, by the next `raywds report`
    once the server is back."""
    with mlflow_server(tmp_path / "mlflow") as gone:
        run = tmp_path / "run"
        args = [*RAYWDS, "train", "--data", str(shards), "--recipe", "demo", "--epochs", "2", "--batch-size", "16"]
        args += ["--out", str(run), "--tracking", "mlflow", "--loader-workers", "1"]
        env = {**os.environ, **gone.env("gone"), **planted_slowness.environment(0.05), "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[tuple[float, str]] = []  # each line with when it came
        reader = threading.Thread(
            target=lambda: lines.extend((time.monotonic(), line) for line in process.stdout or []), daemon=True
        )
        reader.start()
        deadline = time.monotonic() + 180
        while not any(line.startswith("epoch 1/2") for _, line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        gone.stop()
        code = process.wait(300)
        reader.join(10)
    output = "".join(line for _, line in lines)
    assert code == 0, output[-3000:]
    assert "epochs 2  top-1" in output, "every epoch trained"
    rows = [json.loads(line) for line in (run / files.METRICS).read_text().splitlines()]
    assert [r["epoch"] for r in rows if r["kind"] == "epoch"] == [1, 2]
    run_id = json.loads((run / files.TRACKING).read_text())["mlflow"]
    [at] = [i for i, (_, line) in enumerate(lines) if line.startswith("raywds: warning: tracking: mlflow: ")]
    assert re.fullmatch(
        rf"raywds: warning: tracking: mlflow: \d+ of \d+ updates were not sent to {re.escape(gone.url)} "
        r"\(connection (refused|lost)\); metrics\.jsonl in the run folder holds every number; "
        rf"the MLflow run {run_id} there stays RUNNING until `raywds report {re.escape(str(run))}` "
        r"or --resume of this run reaches the server\n",
        lines[at][1],
    ), output[-2000:]
    waited = lines[at][0] - lines[at - 1][0]
    assert waited < REFUSED_WITHIN_S, f"the end waited {waited:.1f} s for a server that is gone"
    left = json.loads((run / files.TRACKING).read_text())[NOT_ENDED]["mlflow"]
    assert (left["run_id"], left["uri"], left["status"]) == (run_id, gone.url, "FINISHED")

    with mlflow_server(tmp_path / "mlflow", port=gone.port) as back:
        assert back.client().get_run(run_id).info.status == "RUNNING", "left as the run ended"
        report = subprocess.run([*RAYWDS, "report", str(run)], capture_output=True, text=True, timeout=120)
        assert report.returncode == 0, report.stderr[-2000:]
        said = f"tracking: ended the MLflow run {run_id} at {gone.url} as FINISHED, which the run's end could not reach"
        assert said in report.stdout.splitlines(), report.stdout + report.stderr
        ended = back.client().get_run(run_id).info
    assert (ended.status, ended.end_time) == ("FINISHED", left["end_time"])
    assert json.loads((run / files.TRACKING).read_text()) == {"mlflow": run_id}, "nothing left to end"


def epoch_row(epoch: int) -> dict[str, Any]:
    return {"kind": "epoch", "epoch": epoch, "samples_seen": 120 * epoch, "train_loss": 2.0 / epoch}


def eventually(check: Callable[[], object], within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s"
        time.sleep(0.1)


def test_an_unreachable_tracking_server_is_refused_at_once_in_a_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing listening there, or a server that takes the connection and never answers: the check
    that opening the trackers starts with refuses it within seconds (not after MLflow's minutes of
    retries), in one line naming the server and the way on, before tracking.json is written."""
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # not this machine's `wandb offline`
    monkeypatch.setenv("WANDB_MODE", "online")
    mlflow_fixes = "start the server, fix MLFLOW_TRACKING_URI"
    wandb_fixes = "start the server, fix WANDB_BASE_URL, set WANDB_MODE=offline"
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connections wait in its backlog, unanswered
        never = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cases = [
            ("mlflow", "MLflow", "MLFLOW_TRACKING_URI", closed, "connection refused", mlflow_fixes),
            ("mlflow", "MLflow", "MLFLOW_TRACKING_URI", never, "no answer in 2 s", mlflow_fixes),
            ("wandb", "W&B", "WANDB_BASE_URL", closed, "connection refused", wandb_fixes),
        ]
        for tool, title, setting, server, why, fixes in cases:
            monkeypatch.setenv(setting, server)
            start = time.monotonic()
            with pytest.raises(ConfigError) as refused:
                Trackers.open([tool], {}, tmp_path, None)
            took = time.monotonic() - start
            assert str(refused.value) == (
                f"--tracking {tool}: the {title} server at {server} ({setting}) does not answer ({why}): "
                f"{fixes}, or train without --tracking {tool}"
            )
            assert took < REFUSED_WITHIN_S, f"{server}: refused after {took:.1f} s"
    assert not (tmp_path / files.TRACKING).exists()


def test_a_run_with_an_unreachable_mlflow_server_is_refused_in_one_line_before_it_writes(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from raywds.cli.main import main

    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed)
    out = tmp_path / "r"
    assert main(["train", "--data", str(shards), "--tracking", "mlflow", "--out", str(out), "--epochs", "1"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"raywds: error: --tracking mlflow: the MLflow server at {closed} (MLFLOW_TRACKING_URI) does not answer "
        "(connection refused): start the server, fix MLFLOW_TRACKING_URI, or train without --tracking mlflow"
    )
    written = list(out.iterdir()) if out.exists() else []
    assert written == [], "refused before it wrote"


@pytest.mark.slow  # a real MLflow server: its start is 15-20 s of the inner loop
def test_a_server_gone_at_the_end_is_not_waited_for_and_the_run_continued_ends_what_it_left_running(
    mlflow_server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server gone after epoch 1 (connections refused, as a killed server's): the end says so at
    once, naming it, not after 15 s, and tracking.json keeps the MLflow run it left RUNNING; the run
    continued into its folder (what --resume does) takes that run over and ends it: one run, FINISHED."""
    folder, client = tmp_path / "run", mlflow_server.client()
    folder.mkdir()
    with Gate(mlflow_server.url) as gate:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", gate.url)
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "gone-at-the-end")
        trackers = Trackers.open(["mlflow"], {"train": {"epochs": 2}}, folder, None)
        run_id = trackers.saved()["mlflow"]
        trackers.row(epoch_row(1))
        eventually(lambda: client.get_metric_history(run_id, "epoch"))
        gate.shut()
        trackers.row(epoch_row(2))
        start, wall = time.monotonic(), time.time()
        lines = trackers.close()
        took = time.monotonic() - start
        assert lines == [
            f"mlflow: 2 of 4 updates were not sent to {gate.url} (connection refused); metrics.jsonl in the run "
            f"folder holds every number; the MLflow run {run_id} there stays RUNNING until `raywds report {folder}` "
            "or --resume of this run reaches the server"
        ]
        assert took < REFUSED_WITHIN_S, f"the end waited {took:.1f} s for a server that is gone"
        assert client.get_run(run_id).info.status == "RUNNING"
        left = json.loads((folder / files.TRACKING).read_text())[NOT_ENDED]
        ended_ms = left["mlflow"].pop("end_time")
        assert left == {"mlflow": {"run_id": run_id, "uri": gate.url, "status": "FINISHED"}}
        assert wall * 1000 - 1 <= ended_ms <= (wall + took) * 1000 + 1, "when the run ended"

        gate.open()
        again = Trackers.open(["mlflow"], {"train": {"epochs": 3}}, folder, None)
        assert json.loads((folder / files.TRACKING).read_text()) == {"mlflow": run_id}, "this run ends it"
        again.row(epoch_row(3))
        assert again.close() == []
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "epoch")] == [120, 360], "one run"


@pytest.mark.slow  # a real MLflow server: its start is 15-20 s of the inner loop
def test_a_run_left_running_is_ended_as_it_ended_by_the_next_report_that_reaches_its_server(
    mlflow_server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that failed while its server was gone: tracking.json keeps its MLflow run, left RUNNING,
    to end as FAILED; `raywds report` (and `raywds doctor`: both open the folder with local_copy)
    says it cannot while the server does not answer, and ends it, at the time the run ended, once it
    does."""
    folder, client = tmp_path / "run", mlflow_server.client()
    folder.mkdir()
    with Gate(mlflow_server.url) as gate:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", gate.url)
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "left-running")
        trackers = Trackers.open(["mlflow"], {}, folder, None)
        run_id = trackers.saved()["mlflow"]
        gate.shut()
        with pytest.raises(RuntimeError, match="a rank died"):
            try:
                raise RuntimeError("a rank died")
            finally:  # as the launchers close the run folder
                trackers.close()
        left = json.loads((folder / files.TRACKING).read_text())[NOT_ENDED]["mlflow"]
        assert left["status"] == "FAILED"
        capsys.readouterr()
        with local_copy(str(folder)):
            pass
        assert (
            f"raywds: warning: tracking: the MLflow run {run_id} at {gate.url} is still RUNNING (connection refused); "
            f"`raywds report {folder}` ends it once it answers"
        ) in capsys.readouterr().err.splitlines()
        assert client.get_run(run_id).info.status == "RUNNING"
        gate.open()
        with local_copy(str(folder)):
            pass
        assert (
            f"tracking: ended the MLflow run {run_id} at {gate.url} as FAILED, which the run's end could not reach"
        ) in capsys.readouterr().out.splitlines()
    info = client.get_run(run_id).info
    assert (info.status, info.end_time) == ("FAILED", left["end_time"])
    assert json.loads((folder / files.TRACKING).read_text()) == {"mlflow": run_id}


@pytest.mark.slow
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
    assert list((tmp_path / "r").iterdir()) == [], "refused before it wrote"


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
    rows = [json.loads(line) for line in (run / files.METRICS).read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    # wandb-core, a process of its own, may still be writing the last run's file after finish()
    # returned (seen 7 bytes long, whole 3 s later): read it once it holds every epoch, or at 60 s.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if len([h for h in wandbfile.history(offline) if "train_loss" in h]) >= len(epochs):
                break
        except ValueError:  # a file cut short while it is written (header or CRC): read it again
            pass
        time.sleep(0.2)
    logged = [h for h in wandbfile.history(offline) if "train_loss" in h]
    assert [(h["samples_seen"], h["train_loss"]) for h in logged] == [
        (r["samples_seen"], pytest.approx(r["train_loss"])) for r in epochs
    ]


def test_tracking_tensorboard_is_the_tensorboard_flag(shards: Path, tmp_path: Path) -> None:
    from raywds.runs.folder import RunDir

    assert small_config(shards, tracking=["tensorboard"]).trackers() == ["tensorboard"]
    assert small_config(shards, tensorboard=True, tracking=["mlflow"]).trackers() == ["mlflow", "tensorboard"]
    assert small_config(shards, tensorboard=True, tracking=["tensorboard"]).trackers() == ["tensorboard"]
    run = RunDir(tmp_path / "run")
    run.start()
    run.open_tracking(["tensorboard"], {}, None)
    assert run.events is not None and run.events.sender is None, "TensorBoard writes files itself, no thread"
    run.close()
    assert list((tmp_path / "run" / files.TENSORBOARD).glob("events.out.tfevents.*"))


def test_one_table_of_trackers_is_what_every_part_takes() -> None:
    """--tracking's choices (the config's), the trackers a run opens and the Lightning loggers are
    the names of one table; each tracker says its title and the raywds extra its client comes in."""
    import typing

    import tomllib

    from raywds.runs.recording import TrackerName
    from raywds.runs.tracking import TRACKERS

    assert list(TRACKERS) == list(typing.get_args(TrackerName))
    extras = tomllib.loads(Path("pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, tracker in TRACKERS.items():
        assert tracker.name == name and tracker.title and tracker.extra in extras, name
    if importlib.util.find_spec("lightning") is not None:
        from raywds.lightning.loggers import LOGGERS

        assert list(LOGGERS) == list(TRACKERS), "a Lightning logger for each tracker"
