"""A real 2-worker Ray Train TorchTrainer on a private local cluster."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import threading
import uuid
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import save_file
from support.data import epoch_keys, tar_keys
from support.mlflowserver import MlflowServer
from support.runs import assert_charts_hold, small_config

from raywds.errors import ConfigError
from raywds.launch.rayoptions import RayOptions, worker_count
from raywds.runs import files
from raywds.train.config import TrainConfig
from raywds.train.model import DemoNet
from raywds.world import World


@pytest.fixture
def ray_train() -> ModuleType:
    """raywds.launch.ray_train, imported by the tests that use it, not at collection: Ray and Ray
    Train take about 1.5 s to import, which every test process would pay, the inner loop's too."""
    from raywds.launch import ray_train

    return ray_train


def test_rays_known_noise_stays_off_the_console_of_a_driver_that_started_ray_itself(
    ray_train: ModuleType, local_ray: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ray is up already here (as after a notebook's own ray.init()): joining it installs the same
    filter that a cluster `connect` starts gets, so Ray Train's placement-group cleaner's line about
    a late State API stays off the console, and every other line a worker prints still shows."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    ray_train.connect(None)
    mark = uuid.uuid4().hex  # lines Ray's de-duplication has not seen
    noise = f"Failed to query Ray Train Controller actor state. State API may be temporarily unavailable. {mark}"
    kept = f"epoch 1/2: trained {mark}"
    for is_err in (False, True):
        dispatcher.emit(
            dict(ip="10.0.0.1", pid=4242, actor_name="PlacementGroupCleaner", is_err=is_err, lines=[noise, kept])
        )
    out = capsys.readouterr()
    assert out.out.count(kept) == 1 and out.err.count(kept) == 1, out
    assert mark not in out.out.replace(kept, "") + out.err.replace(kept, ""), out


def test_a_package_that_slows_every_ray_process_is_named_with_its_uninstall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from raywds.launch.cluster import warn_slow_imports  # imports Ray

    warn_slow_imports()
    assert not caplog.records, "./run-venv leaves rfc3987-syntax out"
    (tmp_path / "rfc3987_syntax").mkdir()  # importable, as where Jupyter installed it
    (tmp_path / "rfc3987_syntax" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    warn_slow_imports()
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "`pip uninstall rfc3987-syntax`" in caplog.records[0].getMessage()


def test_worker_plan_follows_the_cluster(ray_train: ModuleType) -> None:
    assert ray_train.plan_workers({"CPU": 64, "GPU": 8}, None) == ray_train.WorkerPlan(8, True)
    assert ray_train.plan_workers({"CPU": 64, "GPU": 8}, 4) == ray_train.WorkerPlan(4, True)
    assert ray_train.plan_workers({"CPU": 64, "GPU": 8}, None, loader_workers=6).cpus_per_worker == 7
    assert ray_train.plan_workers({"CPU": 64, "GPU": 8}, None, loader_workers=12).cpus_per_worker == 8, (
        "no more than the cluster has per GPU"
    )
    assert ray_train.plan_workers({"CPU": 64, "GPU": 8}, None, loader_workers=None).cpus_per_worker == 8, "auto: all"
    assert ray_train.plan_workers({"CPU": 2}, None) == ray_train.WorkerPlan(2, False)
    assert ray_train.plan_workers({"CPU": 16}, 6) == ray_train.WorkerPlan(6, False)
    with pytest.raises(ConfigError, match="--num-workers 3 needs 3 CPUs but the cluster has 2; use --num-workers 2"):
        ray_train.plan_workers({"CPU": 2}, 3)
    with pytest.raises(ConfigError, match="needs 16 GPUs but the cluster has 8"):
        ray_train.plan_workers({"CPU": 64, "GPU": 8}, 16)


def test_an_elastic_worker_plan_needs_only_its_minimum_now(ray_train: ModuleType) -> None:
    plan = ray_train.plan_workers({"CPU": 2}, (1, 4))
    assert (plan.ray_num_workers, plan.elastic, plan.describe()) == ((1, 4), True, "1..4 CPU (gloo) workers")
    assert ray_train.plan_workers({"CPU": 64, "GPU": 8}, (4, 16)).ray_num_workers == (4, 16), "more GPUs may come"
    assert ray_train.plan_workers({"CPU": 8}, (3, 3)).ray_num_workers == 3, "MIN..MIN is a fixed count"
    with pytest.raises(ConfigError, match="--num-workers 3 needs 3 CPUs but the cluster has 2"):
        ray_train.plan_workers({"CPU": 2}, (3, 4))
    with pytest.raises(ConfigError, match="the smaller first"):
        ray_train.plan_workers({"CPU": 8}, (4, 2))
    assert worker_count("2..8") == (2, 8) and worker_count("4") == 4
    with pytest.raises(argparse.ArgumentTypeError, match="neither N nor MIN..MAX"):
        worker_count("2-8")


def test_each_data_plane_has_its_placement_and_run_takes_the_commands_defaults(ray_train: ModuleType) -> None:
    import inspect

    from raywds.launch.rayoptions import DATA_PLANES, DEFAULTS

    assert tuple(ray_train.PLACES) == DATA_PLANES
    run = inspect.signature(ray_train.run).parameters
    assert list(run) == ["cfg", "options"] and run["options"].default is DEFAULTS, "one default, the command line's"
    assert DEFAULTS.max_failures == 3
    with pytest.raises(ConfigError, match="--data-plane 'dask' is not one of loader, ray"):
        ray_train.place(small_config("unused"), RayOptions(num_workers=2, data_plane="dask"))


def test_the_controller_polls_often_on_small_runs_and_a_users_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    from raywds.launch.cluster import environ
    from raywds.launch.ray_train import POLL_ENV, controller_polls

    # Ray Train hands this variable from the driver to its controller; if a Ray stops doing so, the
    # setting does nothing and this fails.
    assert POLL_ENV in ENV_VARS_TO_PROPAGATE
    assert controller_polls(2) == {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    assert controller_polls(64) == {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    assert controller_polls(65) == {}, "at scale, Ray's own 2 s: each poll calls every worker"
    monkeypatch.delenv(POLL_ENV, raising=False)
    with environ(controller_polls(2)):
        assert os.environ[POLL_ENV] == "0.5"
    assert POLL_ENV not in os.environ, "set for the run only"
    monkeypatch.setenv(POLL_ENV, "3")
    with environ(controller_polls(2)):
        assert os.environ[POLL_ENV] == "3", "the user's own interval"
    assert os.environ[POLL_ENV] == "3"


def test_storage_uris_pass_through_and_paths_become_absolute(tmp_path: Path) -> None:
    from raywds.launch.cluster import split_storage  # imports Ray

    assert split_storage("s3://bucket/runs") == ("s3://bucket/runs", None), "a URI goes to Ray untouched"
    assert split_storage("file:///mnt/shared/runs") == ("file:///mnt/shared/runs", "/mnt/shared/runs")
    relative = os.path.relpath(tmp_path / "runs")
    assert split_storage(relative) == (str(tmp_path / "runs"), str(tmp_path / "runs"))


def split_config(data: Path, audit: Path, **overrides: object) -> TrainConfig:
    return small_config(
        data,
        **{
            "batch_size": 8,
            "epochs": 1,
            "mode": "split",
            "audit_dir": str(audit),
            "pg_timeout": 60,
            **overrides,
        },
    )


def test_a_bad_sample_under_ray_is_one_line_naming_shard_and_sample(
    ray_train: ModuleType, shards: Path, tmp_path: Path, local_ray: None
) -> None:
    """A non-image member in split mode: the failing rank's own line, not Ray's snippets."""
    import re
    import shutil
    import tarfile

    from raywds.loader.stages import SampleError

    data = tmp_path / "shards"
    shutil.copytree(shards, data)
    shard = json.loads((data / "manifest.json").read_text())["splits"]["train"]["shards"][0]["name"]
    with tarfile.open(data / shard) as tar:  # same size, so the manifest's byte count still holds
        member = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))
    raw = bytearray((data / shard).read_bytes())
    raw[member.offset_data : member.offset_data + member.size] = b"x" * member.size
    (data / shard).write_bytes(bytes(raw))
    key = member.name.rsplit(".", 1)[0]
    with pytest.raises(SampleError) as caught:
        ray_train.run(  # no restarts: each would meet the same sample again
            split_config(data, tmp_path / "audit"),
            RayOptions(storage_path=str(tmp_path), name=f"bad-{uuid.uuid4().hex[:8]}", max_failures=0),
        )
    line = str(caught.value)
    assert "\n" not in line and "Traceback" not in line, line
    assert re.fullmatch(
        (
            rf"shard \S+/{re.escape(shard)}: sample {re.escape(key)} \({re.escape(member.name)}\): cannot identify "
            r"image file \(rank [01]\)"
        ),
        line,
    ), line


def test_a_stopped_ray_run_resumes_mid_epoch_without_repeats_and_keeps_its_record(
    ray_train: ModuleType,
    uneven: Path,
    tmp_path: Path,
    local_ray: None,
    mlflow_server: MlflowServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2 Ray Train workers in split mode on uneven shards, stopped after 3 steps of epoch 1, then
    resumed from that checkpoint for the rest of 3 epochs: every epoch exact over both runs, and the
    resumed run's record as a run's own (Ray's checkpoints, best/, progress rows, TensorBoard).
    The shards are named as a WebDataset user names shards (a brace list, a glob for validation),
    not by their manifest: webdataset's TarWriter wrote them, and the driver indexes them on first
    use into the run's index cache, where the workers and the resumed run find the index. With
    --tracking mlflow, both runs (two run folders) are one MLflow run, its id kept in the checkpoint,
    the driver's MLFLOW_* settings reaching rank 0 in its Ray worker."""
    import ray

    experiment = f"ray-{uuid.uuid4().hex[:8]}"
    for name, value in mlflow_server.env(experiment).items():
        monkeypatch.setenv(name, value)

    audit = tmp_path / "audit"
    # The first run fine-tunes from a weights file named relative to the driver's folder.
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(5)
    save_file(DemoNet(10).state_dict(), "start.safetensors")
    cfg = split_config(
        f"{uneven}/uneven-train-{{000000..000008}}.tar",
        audit,
        initial_checkpoint="start.safetensors",
        val_data=f"{uneven}/imagenet-val-*.tar",
        index_cache=str(tmp_path / "index"),
        epochs=3,
        max_steps=3,
        log_every=0.0,
        tensorboard=True,
        tracking=["mlflow"],
    )
    first = ray_train.run(cfg, RayOptions(storage_path=str(tmp_path), name=f"stop-{uuid.uuid4().hex[:8]}"))
    assert first.plan == ray_train.WorkerPlan(2, use_gpu=False)
    assert first.metrics["inside_epoch"] and first.metrics["step"] == 3 and first.checkpoint is not None
    assert sum(epoch_keys(audit, 0, uneven).values()) == 2 * 3 * 8
    started = torch.load(Path(first.checkpoint) / files.CHECKPOINT, weights_only=True)["weights"]
    digest = hashlib.sha256((tmp_path / "start.safetensors").read_bytes()).hexdigest()
    assert (started["source"], started["sha256"]) == (f"file {tmp_path / 'start.safetensors'}", digest)

    second = ray_train.run(
        dataclasses.replace(cfg, max_steps=None, resume=first.checkpoint),
        RayOptions(storage_path=str(tmp_path), name=f"resume-{uuid.uuid4().hex[:8]}", keep_checkpoints=None),
    )
    everything = Counter(tar_keys(uneven))
    assert epoch_keys(audit, 0, uneven) == everything, "epoch 1 over both runs: every key once"
    # Epochs 2 and 3, whole: 9 shards of 1..30 samples dealt to 2 ranks, different batch counts per rank, under Join
    for epoch in (1, 2):
        assert epoch_keys(audit, epoch, uneven) == everything, f"epoch {epoch + 1}"
        assert len(list(audit.glob(f"epoch{epoch:04d}-*.ids"))) == 2, "both ranks trained"
    assert second.metrics["epoch_samples"] == second.metrics["train_samples"] == 120
    assert second.metrics["epoch_duplicates"] == second.metrics["epoch_missing"] == 0
    assert second.metrics["epoch"] == 3 and second.metrics["samples_seen"] == 360
    assert len(list((tmp_path / "index").glob("*/manifest.json"))) == 1, "indexed once, for the driver and both runs"
    assert [m["epoch"] for m in second.history] == [1, 2, 3]
    assert second.history[0]["train_samples"] == 120 - 48, "the resumed run trained only on the rest of epoch 1"
    losses = [m["train_loss"] for m in second.history]
    assert losses[-1] < losses[0], losses
    assert second.metrics["val_samples"] == 50
    assert 0 <= second.metrics["stages"]["idle_cpus"] <= 4 - 2, "the doctor knows the CPUs the run left idle"

    # The resumed run's folder: Ray's checkpoints, the best one beside them, a progress row a step
    assert second.checkpoint is not None and (Path(second.checkpoint) / files.CHECKPOINT).is_file()
    assert Path(second.path).is_relative_to(tmp_path)
    best = json.loads((Path(second.path) / "best" / "metrics.json").read_text())
    assert best["val_top1"] == max(m["val_top1"] for m in second.history), "best/ holds the best top-1"
    assert (Path(second.path) / "best" / files.CHECKPOINT).is_file()
    rows = [json.loads(line) for line in (Path(second.path) / "metrics.jsonl").read_text().splitlines()]
    progress = [r for r in rows if r.get("kind") == "progress"]
    # rank 0's 8 steps an epoch: the 5 of epoch 1 after the stop's 3, then epochs 2 and 3 whole
    assert [r["step_in_epoch"] for r in progress] == [*range(1, 6), *range(1, 9), *range(1, 9)], progress
    assert [r["step"] for r in progress] == list(range(4, 25)), "the resumed run counts on from the stop's step 3"
    # --tensorboard: rank 0's event file in the run folder, though Ray ends the worker without closing it
    assert_charts_hold(Path(second.path) / "tensorboard", rows, num_ranks=2)
    # Ray Train's controller asks the autoscaling coordinator for resources as it starts, with a 5 s
    # timeout: were the coordinator started by that request, its process's start would count against
    # it (a GetTimeoutError traceback on a busy machine). The run starts it first and waits for it.
    started = [(a["StartTime"], a["ActorClassName"]) for a in ray.state.actors().values()]
    coordinator = [t for t, name in started if name == "_AutoscalingCoordinatorActor"]
    controllers = [t for t, name in started if name == "TrainController"]
    assert len(coordinator) == 1 and controllers, started
    assert coordinator[0] <= min(controllers), "the autoscaling coordinator was up before the first controller"
    [tracked] = mlflow_server.runs(experiment)
    seen = mlflow_server.client().get_metric_history(tracked.info.run_id, "samples_seen")
    assert [m.step for m in seen] == [
        3 * 16,
        *[r["samples_seen"] for r in rows if r["kind"] in ("epoch", "checkpoint")],
    ]


def test_a_relative_local_path_reaches_the_workers_absolute(
    ray_train: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's workers run in a folder of Ray's: `--data runs/demo/shards`, as the README's Python
    example gives it, must reach them as the driver meant it (it named nothing there before);
    URLs, `pipe:` commands and lists of servers pass as they are."""
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(
        data="runs/demo/shards", val_data="file://val", shards_at="http://a:8080,http://b:8080", cache_dir="pipe:x"
    )
    moved = ray_train.absolute(cfg)
    assert (moved.data, moved.val_data) == (str(tmp_path / "runs/demo/shards"), str(tmp_path / "val"))
    assert (moved.shards_at, moved.cache_dir, moved.audit_dir) == ("http://a:8080,http://b:8080", "pipe:x", None)
    assert ray_train.absolute(TrainConfig(data="s3://b/p/")).data == "s3://b/p/"


def assert_ray_still_answers(after: str, within_s: float = 60) -> None:
    """This driver can still start an actor and call it: a loader worker forked from a process
    connected to Ray once left the driver's next call to Ray (the actor's registration) waiting for
    ever, and every Ray test after it."""
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, value: int) -> int:
            return value

    answered: list[int] = []
    thread = threading.Thread(target=lambda: answered.append(ray.get(Echo.remote().echo.remote(7))), daemon=True)
    thread.start()
    thread.join(within_s)
    assert answered == [7], f"Ray did not answer within {within_s:.0f} s {after}"


def test_async_validation_lands_each_epochs_exact_numbers_in_its_row_and_best(
    ray_train: ModuleType, shards: Path, tmp_path: Path, local_ray: None
) -> None:
    """--async-validation: the ranks do not validate; each epoch's checkpoint is scored in a Ray task
    of its own, and its numbers land in that epoch's row (a validation row, merged by `epochs`), in
    TensorBoard at the epoch, and in best/, which holds the best epoch's checkpoint though Ray keeps
    only the latest one. The numbers are `raywds evaluate`'s on that checkpoint, exactly."""
    from raywds.infer.evaluation import Scoring, evaluate, validation_numbers
    from raywds.models.trained import load_trained
    from raywds.runs.rows import epochs, read_rows

    cfg = split_config(shards, tmp_path / "audit", epochs=3, tensorboard=True)
    run = ray_train.run(
        cfg,
        RayOptions(
            storage_path=str(tmp_path), name=f"apart-{uuid.uuid4().hex[:8]}", async_validation=True, keep_checkpoints=1
        ),
    )
    rows = read_rows(Path(run.path) / files.METRICS)
    trained_rows = [r for r in rows if r["kind"] == "epoch"]
    assert [r["epoch"] for r in trained_rows] == [1, 2, 3]
    assert not any("val_top1" in r for r in trained_rows), "the ranks validated in the loop"
    validated = [r for r in rows if r["kind"] == "validation"]
    assert sorted(r["epoch"] for r in validated) == [1, 2, 3], "one validation row per epoch"
    merged = epochs(rows)
    assert [r["val_samples"] for r in merged] == [50, 50, 50]
    assert [r["step"] for r in validated] == [r["step"] for r in trained_rows]
    assert run.metrics["val_top1"] == merged[-1]["val_top1"], "the run's last metrics carry the last validation"

    best = json.loads((Path(run.path) / files.BEST_ROW).read_text())
    assert best["val_top1"] == max(r["val_top1"] for r in merged)
    assert best["epoch"] == max(merged, key=lambda r: (r["val_top1"], -r["epoch"]))["epoch"], "the first best epoch"
    trained = load_trained(str(Path(run.path) / files.BEST))
    assert trained.config["train"]["epochs"] == 3
    again = validation_numbers(evaluate(Scoring.of(trained, TrainConfig.from_dict(trained.config)), World()))
    assert again["val_top1"] == best["val_top1"] and again["val_samples"] == 50
    assert again["val_loss"] == pytest.approx(best["val_loss"], rel=1e-9)
    assert_ray_still_answers("after an evaluation with a loader worker in this Ray driver")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    charts = EventAccumulator(str(Path(run.path) / "tensorboard")).Reload()
    assert [e.step for e in charts.Scalars("epoch/val_top1")] == [1, 2, 3]


def test_a_token_the_cluster_refuses_is_one_line(ray_temp: Path, tmp_path: Path) -> None:
    """Another cluster's token: Ray's words for it ran to a paragraph, in a traceback; now one line
    naming where the token goes, exit 1 (tests/test_cli.py has the cases that need no cluster)."""
    import subprocess
    import sys

    from support.raycluster import head_node, token_env, write_token

    another = token_env(write_token(tmp_path))
    another.update(RAY_gcs_server_port_wait_time_s="2", PYTHONUNBUFFERED="1")  # Ray tries 20 times, 1 s apart
    with head_node(ray_temp) as head:
        command = [sys.executable, "-m", "raywds", "ray", "--address", head.gcs_address, "--data", str(tmp_path)]
        ran = subprocess.run(command, env=another, capture_output=True, text=True, timeout=240)
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr[-3000:]
    assert [line for line in ran.stderr.splitlines() if line.startswith("raywds: ")] == [
        f"raywds: error: Failed to connect to Ray cluster at {head.gcs_address}: it refused this process's token; "
        "give every process the cluster's token (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token; "
        "`ray get-auth-token --generate` writes one for a new cluster), see docs/cluster.md"
    ], ran.stderr[-3000:]
