"""raywds's shards as a LightningDataModule: the same plan, readers, decoders and modes as
`raywds train`, configured by the same `TrainConfig`.

    cfg = resolve("runs/demo-data/shards", recipe="demo", config_file="split.toml")
    data = ShardDataModule(cfg)
    trainer = L.Trainer(max_epochs=cfg.epochs, strategy="ddp", ...)
    trainer.fit(model, datamodule=data)                      # or ckpt_path=... to resume mid-epoch

Each epoch's training loader is planned for the epoch Lightning runs and the rank it runs as
(so the DataModule makes Lightning reload loaders every epoch). A batch reaches the model as
`(images, labels)`: float NCHW, normalised on the device as `raywds train` does, and int64.
The DataModule's callback (raywds.lightning.epochs, added to the Trainer in `setup`) counts
what each rank trains, keeps split epochs exact under DDP, checks them at each epoch's end, and
takes `cfg.checkpoint_every_steps` checkpoints; `state_dict` carries the epoch's position into
Lightning's checkpoints, so `Trainer.fit(ckpt_path=...)` trains exactly what is left, on any
number of ranks. Validation is exact: each rank its own share, no padding.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch

from raywds.data.dataset import manifest_of
from raywds.errors import ConfigError, DataError
from raywds.lightning.epochs import ExactEpochs
from raywds.loader.decodings import decoding
from raywds.loader.loader import PerRank
from raywds.loader.stages import Batch
from raywds.train.autoworkers import first
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig
from raywds.train.epoch import EpochKeeper
from raywds.world import World


class Batches:
    """An epoch's batches for Lightning: its length counts the steps a resumed epoch already
    took (Lightning's fetcher counts on from them), so the epoch ends where the plan does."""

    def __init__(self, batches: Iterable[Batch], length: int):
        self.batches, self.length = batches, length

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)

    def __len__(self) -> int:
        return self.length


class ShardDataModule(pl.LightningDataModule):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        if not decoding(cfg.decode).in_workers:
            raise ConfigError("the Lightning DataModule decodes on the CPU: use --decode cpu or pil")
        if cfg.global_batch is not None:
            raise ConfigError(
                "global_batch is raywds train's: with Lightning, accumulate with Trainer(accumulate_grad_batches=...)"
            )
        if cfg.model_ema:
            raise ConfigError(
                "model_ema is raywds train's: with Lightning, average the weights with its "
                "WeightAveraging callback (lightning.pytorch.callbacks)"
            )
        if cfg.mixup_alpha or cfg.cutmix_alpha:
            raise ConfigError(
                "mixup_alpha and cutmix_alpha mix batches on the device in raywds train: with Lightning, apply "
                "torchvision.transforms.v2.MixUp/CutMix in your LightningModule's training_step"
            )
        if cfg.loader_workers == "auto":  # no epoch is measured here: start as raywds train does
            cfg = dataclasses.replace(cfg, loader_workers=first(len(os.sched_getaffinity(0))).workers)
        self.cfg = cfg
        self.loader_cfg = cfg.loader()
        """The loader's slice of the config for validation (its worker count is fixed here); each
        training epoch takes its own, at the epoch's crop size."""
        self.manifest = manifest_of(cfg)
        self.num_classes = len(self.manifest.classes)
        self.num_samples = self.manifest.num_samples("train")
        self.keeper = EpochKeeper(cfg, World(), self.manifest)
        """The epochs' bookkeeping, as `raywds train` keeps it (its world is the Trainer's, from `setup`)."""
        self.callback = ExactEpochs(self.keeper)
        self.loaders = PerRank()
        """The loader workers, kept from epoch to epoch (stopped at `teardown`)."""
        self._compute: Compute | None = None

    @property
    def metrics(self) -> dict[str, Any]:
        """The last finished epoch's counts (every rank): epoch, epoch_samples, samples_seen, images_per_s."""
        return self.callback.metrics

    @property
    def memory_format(self) -> torch.memory_format:
        """The batches' layout on this machine's device, as `raywds train` chooses it (channels_last
        on CUDA): the model's should match."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.channels_last if Compute.for_run(self.cfg, device).channels_last else torch.contiguous_format

    @property
    def samples_seen(self) -> int:
        """Samples trained on, all ranks, in the epochs finished (and the resumed run's before them)."""
        return self.keeper.progress.samples_seen

    def world(self) -> World:
        t = self.trainer
        assert t is not None, "the DataModule is used by a Trainer"
        return World(
            rank=t.global_rank,
            world_size=t.world_size,
            local_rank=t.local_rank,
            ranks_per_node=max(t.num_devices, 1),
            device=str(t.strategy.root_device),
        )

    def setup(self, stage: str) -> None:
        t = self.trainer
        assert t is not None
        self.keeper.world = self.world()
        t.reload_dataloaders_every_n_epochs = 1  # type: ignore[attr-defined]  # each epoch its own plan
        callbacks: list[pl.Callback] = t.callbacks  # type: ignore[attr-defined]
        if not any(c is self.callback for c in callbacks):
            callbacks.insert(0, self.callback)  # first: before any checkpoint callback's collectives

    def train_dataloader(self) -> Batches:
        t, world = self.trainer, self.keeper.world
        assert t is not None
        epoch = self.keeper.begin(t.current_epoch)
        plan = epoch.plan
        if world.distributed and plan.min_batches == 0:  # Lightning stops a rank with no batches: the rest would hang
            raise DataError(
                f"epoch {epoch.index + 1} leaves rank {plan.batches_per_rank.index(0)} of {world.world_size} no "
                f"batch ({sum(plan.samples_per_rank)} samples left): resume it on fewer ranks"
            )
        batches = self.loaders.train(
            self.manifest, self.cfg.loader(epoch.index), world, plan, epoch=epoch.index,
            position=epoch.position,
        )  # fmt: skip
        return Batches(batches, epoch.step_before + len(batches))

    def val_dataloader(self) -> Iterable[Batch]:
        """This rank's share of the validation split, every sample once across ranks (no
        padding: ranks may take different numbers of batches, and none makes a collective)."""
        if "val" not in self.manifest.splits:
            return []
        return self.loaders.val(self.manifest, self.loader_cfg, self.world())

    def teardown(self, stage: str) -> None:
        """The loader workers stop with the Trainer's fit (or validate) call."""
        self.loaders.close()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A training batch is counted here, as the step that trains it begins; the model gets (images, labels)."""
        if not isinstance(batch, Batch):
            return batch
        t, epoch = self.trainer, self.keeper.epoch
        if t is not None and t.training and epoch is not None and not epoch.closed:
            self.keeper.mark(batch)
        return batch.images, batch.labels

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        if self._compute is None:
            self._compute = Compute.for_run(self.cfg, str(images.device))
        return self._compute.inputs(images, labels)

    def step(self) -> int:
        """Steps so far, the same on every rank: the finished epochs' (their longest rank's), then this one's."""
        epoch = self.keeper.epoch
        return epoch.steps if epoch is not None and not epoch.closed else self.keeper.progress.steps

    def lr(self) -> float:
        """The learning rate of the step being trained, as `raywds train` sets it: warm-up, then
        cosine decay, on the clock of epochs done (raywds.train.epoch.EpochKeeper.lr)."""
        epoch = self.keeper.epoch
        return self.keeper.lr(epoch.ran) if epoch is not None and not epoch.closed else self.keeper.lr(0)

    def state_dict(self) -> dict[str, Any]:
        """The epoch keeper's counters and position (a collective in split mode: every rank calls
        it, as Lightning does when it saves a checkpoint)."""
        self.keeper.record()
        return self.keeper.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.keeper.load_state_dict(state)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, tuple) and len(batch) == 2:
            return tuple(x.to(device, non_blocking=True) for x in batch)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)
