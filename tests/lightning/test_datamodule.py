"""raywds.lightning.ShardDataModule in one process, without a Trainer's run: what it refuses, and
the batches it hands a model."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
from support.runs import small_config

from raywds.errors import ConfigError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="no lightning (its extra)")
# raywds.lightning is imported in each test, not here: collecting this file in every pytest-xdist
# worker would otherwise import Lightning in each (seconds), where one worker runs these tests.


def test_decoding_on_the_device_is_refused_in_one_line(shards: Path) -> None:
    from raywds.lightning import ShardDataModule

    with pytest.raises(ConfigError, match=re.escape("decodes on the CPU: use --decode cpu or pil")):
        ShardDataModule(small_config(shards, decode="device"))


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"global_batch": 32}, "global_batch is raywds train's: with Lightning, accumulate with Trainer("),
        (
            {"model_ema": True},
            "model_ema is raywds train's: with Lightning, average the weights with its WeightAveraging",
        ),
        ({"cutmix_alpha": 1.0}, "mix batches on the device in raywds train: with Lightning, apply torchvision"),
    ],
)
def test_raywds_trains_own_settings_are_refused_in_one_line(shards: Path, setting: dict, said: str) -> None:
    from raywds.lightning import ShardDataModule

    with pytest.raises(ConfigError, match=re.escape(said)):
        ShardDataModule(small_config(shards, **setting))


def test_auto_loader_workers_start_at_the_cores_less_one(shards: Path) -> None:
    import os

    from raywds.lightning import ShardDataModule

    data = ShardDataModule(small_config(shards, loader_workers="auto"))
    assert data.cfg.loader_workers == max(1, len(os.sched_getaffinity(0)) - 1)
    assert (data.num_classes, data.num_samples) == (10, 120)


def test_a_fit_in_one_process_counts_the_epochs_and_hands_the_model_normalised_batches(
    shards: Path, tmp_path: Path
) -> None:
    import lightning.pytorch as L
    import torch
    from torch import nn

    from raywds.lightning import ShardDataModule

    seen: list[tuple[torch.dtype, torch.dtype, float]] = []

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(10))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            images, labels = batch
            seen.append((images.dtype, labels.dtype, float(images.mean())))
            return nn.functional.cross_entropy(self.net(images), labels)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = ShardDataModule(small_config(shards, epochs=2, out=str(tmp_path)))
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(Probe(), datamodule=data)
    assert data.metrics["epoch"] == 2 and data.samples_seen == 2 * 128  # resample: 8 batches of 16
    assert data.step() == 16 and trainer.reload_dataloaders_every_n_epochs == 1
    assert trainer.callbacks[0] is data.callback, "the DataModule's callback comes first"
    assert {(x, y) for x, y, _ in seen} == {(torch.float32, torch.int64)} and len(seen) == 16
    assert all(-3 < mean < 3 for _, _, mean in seen), "normalised, not 0..255"


def _train_rates(cfg, monkeypatch: pytest.MonkeyPatch) -> list[float]:  # type: ignore[no-untyped-def]
    """The rate `raywds train` sets before each step of `cfg`'s run, in one process."""
    import raywds.train.loop
    from raywds.train.trainer import train
    from raywds.world import World

    rates: list[float] = []
    real = raywds.train.loop.set_lr

    def recorded(optimizer, lr: float) -> None:  # type: ignore[no-untyped-def]
        rates.append(lr)
        real(optimizer, lr)

    monkeypatch.setattr(raywds.train.loop, "set_lr", recorded)
    train(cfg, World())
    return rates


def test_the_learning_rate_follows_raywds_trains_clock_with_batches_per_epoch(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --batches-per-epoch an epoch is that many batches, not the manifest's samples: both
    trainers' learning rate reaches the end of its warm-up and its cosine at the same steps.
    (The DataModule counted epochs by the manifest's 120 samples: its rate after 3 batches of
    16 was 0.4 of an epoch on, where `raywds train`'s was a whole one.)"""
    import lightning.pytorch as L
    import torch
    from torch import nn

    from raywds.lightning import ShardDataModule

    cfg = small_config(shards, epochs=2, batches_per_epoch=3, warmup_epochs=1.0, lr=0.1, out=str(tmp_path / "train"))
    expected = _train_rates(cfg, monkeypatch)
    data = ShardDataModule(dataclasses.replace(cfg, out=str(tmp_path / "lightning")))
    rates: list[float] = []

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(10))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            rates.append(data.lr())
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(Probe(), datamodule=data)
    assert len(expected) == 6 and rates == pytest.approx(expected)


@pytest.mark.slow
def test_tracking_in_a_lightning_fit_is_one_mlflow_run_over_two_fits_into_one_folder(
    shards: Path, tmp_path: Path, mlflow_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--tracking mlflow` for a Lightning fit: Lightning's MLFlowLogger, its run's id kept in the
    run folder, so a second fit into the same --out (a resume) continues the same run."""
    import lightning.pytorch as L
    import torch
    from support.mlflowserver import MlflowServer
    from torch import nn

    from raywds.lightning import ShardDataModule
    from raywds.lightning.loggers import KeepTrackingIds, loggers

    assert isinstance(mlflow_server, MlflowServer)
    for name, value in mlflow_server.env("lightning").items():
        monkeypatch.setenv(name, value)

    class Probe(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(10))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    cfg = small_config(shards, epochs=1, out=str(tmp_path), tracking=["mlflow"])
    for _ in range(2):
        trainer = L.Trainer(
            max_epochs=1, accelerator="cpu", devices=1, logger=loggers(cfg), callbacks=[KeepTrackingIds()],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=2, default_root_dir=str(tmp_path),
        )  # fmt: skip
        trainer.fit(Probe(), datamodule=ShardDataModule(cfg))
    [run] = mlflow_server.runs("lightning")
    history = mlflow_server.client().get_metric_history(run.info.run_id, "train_loss")
    assert len(history) == 2 * 4, "8 batches a fit, logged every 2 steps, both fits in the one run"
