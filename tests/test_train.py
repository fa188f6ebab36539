"""The training loop without Ray: one process, and two gloo processes in split mode with Join."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raywds.config import TrainConfig
from raywds.errors import ConfigError
from raywds.loader import val_loader
from raywds.shards import read_manifest
from raywds.train import DemoNet, LocalReport, build_model, evaluate, lr_at, summary_line, train
from raywds.world import World


def tiny(shards: Path, **overrides: object) -> TrainConfig:
    values: dict = dict(
        data=str(shards), model="demo", optimizer="adamw", lr=3e-3, batch_size_per_rank=16, image_size_px=28,
        crop_scale_min=0.5, num_loader_workers_per_rank=1, num_epochs=4, warmup_epochs=0.0,
    )  # fmt: skip
    values.update(overrides)
    return TrainConfig(**values)


def test_local_training_learns_and_checkpoints(shards: Path, tmp_path: Path) -> None:
    cfg = tiny(shards)
    report = LocalReport(tmp_path)
    final = train(cfg, World(), report)
    history = [json.loads(line) for line in report.metrics_path.read_text().splitlines()]
    assert [m["epoch"] for m in history] == [1, 2, 3, 4]
    assert history[-1]["train_loss"] < 0.8 * history[0]["train_loss"], history
    assert final["val_samples"] == 50
    assert final["samples_seen"] == 4 * 128  # ceil(120 / 16) = 8 full batches per epoch
    state = torch.load(report.checkpoint_path, weights_only=False)
    assert state["epoch"] == 4 and state["classes"] == read_manifest(str(shards)).classes
    model = DemoNet(10)
    model.load_state_dict(state["model"])
    again = evaluate(model, val_loader(read_manifest(str(shards)), cfg, World()), World())
    assert again["val_top1"] == pytest.approx(final["val_top1"])
    assert summary_line(final).startswith("epochs 4  top-1 ")


def _split_rank(rank: int, cfg: TrainConfig, store: str, out: str) -> None:
    torch.set_num_threads(1)  # one core per rank, as Ray gives each CPU worker
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        metrics = train(cfg, World(rank=rank, world_size=2))
        Path(out, f"rank{rank}.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


def test_split_mode_with_uneven_ranks_finishes_under_join(shards: Path, tmp_path: Path) -> None:
    # 2 ranks x 1 worker: 64 and 56 samples, so 8 and 7 batches of 8; without Join rank 0 would
    # wait in its 8th all-reduce until the 60 s timeout and fail.
    cfg = tiny(shards, mode="split", batch_size_per_rank=8, num_epochs=2, num_loader_workers_per_rank=1)
    mp.start_processes(_split_rank, args=(cfg, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1], "metrics are all-reduced, so every rank reports the same"
    assert results[0]["train_samples"] == 120, "split mode trains on every sample exactly once"
    assert results[0]["samples_seen"] == 240
    assert results[0]["val_samples"] == 50


def test_learning_rate_warms_up_then_decays_to_zero() -> None:
    cfg = TrainConfig(data="x", lr=0.4, warmup_epochs=1.0, num_epochs=5)
    rates = [lr_at(cfg, World(), e) for e in (0.0, 0.5, 1.0, 3.0, 5.0)]
    assert rates == pytest.approx([0.0, 0.2, 0.4, 0.2, 0.0])


def test_models_by_name() -> None:
    model = build_model("resnet18", 7)
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 7)
    with pytest.raises(ConfigError, match="unknown model 'resnet7'; use `demo` or a torchvision model"):
        build_model("resnet7", 7)


def test_config_errors_name_the_value_and_fix() -> None:
    with pytest.raises(ConfigError, match="batch_size_per_rank=0 must be at least 1"):
        TrainConfig(data="x", batch_size_per_rank=0)
    with pytest.raises(ConfigError, match="mode='exact' is not one of resample, split"):
        TrainConfig(data="x", mode="exact")  # type: ignore[arg-type]
    assert TrainConfig(data="x", batch_size_per_rank=64).peak_lr(world_size=8) == pytest.approx(0.2)
