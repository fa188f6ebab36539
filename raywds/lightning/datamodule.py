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

from raywds.config import TrainConfig
from raywds.data.columns import sample_counts
from raywds.data.dataset import manifest_of
from raywds.errors import ConfigError, DataError
from raywds.lightning.epochs import EpochRun, ExactEpochs
from raywds.loader.decodings import decoding
from raywds.loader.loader import train_loader, val_loader
from raywds.loader.settings import LoaderConfig
from raywds.loader.stages import Batch, bad_sample_id
from raywds.plan.checks import check_plan
from raywds.plan.modes import epoch_plan, parse
from raywds.plan.position import Position, done_in
from raywds.train.audit import Audit
from raywds.train.autoworkers import first
from raywds.train.compute import Compute
from raywds.train.ledger import Ledger
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
        if cfg.loader_workers == "auto":  # no epoch is measured here: start as raywds train does
            cfg = dataclasses.replace(cfg, loader_workers=first(len(os.sched_getaffinity(0))).workers)
        self.cfg = cfg
        self.loader_cfg = LoaderConfig.of(cfg)
        """The loader's slice of the config, built once (its worker count is fixed here)."""
        self.manifest = manifest_of(cfg)
        self.mode = parse(cfg.mode)
        self.num_classes = len(self.manifest.classes)
        self.num_samples = self.manifest.num_samples("train")
        self.sizes = sample_counts(self.manifest.shards("train"))
        self.callback = ExactEpochs(self)
        self.position: Position | None = None
        """Restored from a checkpoint taken inside an epoch: what that epoch had trained."""
        self.epoch: EpochRun | None = None
        self.audit: Audit | None = None
        self.samples_seen = 0
        """Samples trained on, all ranks, in the epochs finished (and the resumed run's before them)."""
        self.steps_before = 0
        """Steps of the epochs finished, each counted as its longest rank's batches, as `raywds train`
        counts them: the same on every rank (Lightning's `global_step` is not, in split mode, where a
        rank that ran out early took fewer optimizer steps). The audit files' segments use it."""
        self.metrics: dict[str, Any] = {}
        """The last finished epoch's counts (every rank): epoch, epoch_samples, samples_seen, images_per_s."""
        self._compute: Compute | None = None

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
        t.reload_dataloaders_every_n_epochs = 1  # type: ignore[attr-defined]  # each epoch its own plan
        callbacks: list[pl.Callback] = t.callbacks  # type: ignore[attr-defined]
        if not any(c is self.callback for c in callbacks):
            callbacks.insert(0, self.callback)  # first: before any checkpoint callback's collectives

    def train_dataloader(self) -> Batches:
        t, cfg, world = self.trainer, self.cfg, self.world()
        assert t is not None
        index = t.current_epoch
        position = self.position if self.position is not None and self.position.epoch == index else None
        plan = epoch_plan(
            self.manifest, cfg, world.world_size, epoch=index, done=done_in(position, index),
            ranks_per_node=world.ranks_per_node,
        )  # fmt: skip
        check_plan(plan, self.manifest)
        if world.distributed and plan.min_batches == 0:  # Lightning stops a rank with no batches: the rest would hang
            raise DataError(
                f"epoch {index + 1} leaves rank {plan.batches_per_rank.index(0)} of {world.world_size} no batch "
                f"({sum(plan.samples_per_rank)} samples left): resume it on fewer ranks"
            )
        if self.audit is None:
            self.audit = Audit(cfg.audit_dir, world, self.steps_before + (position.step if position else 0))
        self.epoch = EpochRun(index, plan, position, Ledger(self.sizes))
        batches = train_loader(self.manifest, self.loader_cfg, world, plan, epoch=index, position=position)
        return Batches(batches, self.epoch.step_before + len(batches))

    def val_dataloader(self) -> Iterable[Batch]:
        """This rank's share of the validation split, every sample once across ranks (no
        padding: ranks may take different numbers of batches, and none makes a collective)."""
        if "val" not in self.manifest.splits:
            return []
        return val_loader(self.manifest, self.loader_cfg, self.world())

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A training batch is counted here, as the step that trains it begins; the model gets (images, labels)."""
        if not isinstance(batch, Batch):
            return batch
        t, epoch = self.trainer, self.epoch
        if t is not None and t.training and epoch is not None:
            epoch.ledger.mark(batch.ids)
            epoch.samples += len(batch.labels)
            epoch.bad.update((bad_sample_id(why), why) for why in batch.bad_samples)
            if self.audit is not None:
                self.audit.write(epoch.index, batch.ids)
        return batch.images, batch.labels

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        if self._compute is None:
            self._compute = Compute.for_run(self.cfg, str(images.device))
        return self._compute.inputs(images, labels)

    def step(self) -> int:
        """Steps so far, the same on every rank: the finished epochs' (their longest rank's), then this one's."""
        epoch = self.epoch
        return self.steps_before + (epoch.steps if epoch is not None and not epoch.closed else 0)

    def progress(self, ahead: int = 0) -> float:
        """Epochs done, fractional, `ahead` steps on: the clock of `raywds train`'s learning-rate
        schedule (raywds.train.optim.lr_at), the same on every rank at an epoch's boundaries."""
        epoch = self.epoch
        if epoch is None:
            return 0.0
        ran = epoch.steps - epoch.step_before + ahead
        done = epoch.done_before + ran * self.world().world_size * self.cfg.batch_size
        return epoch.index + min(done / max(self.num_samples, 1), 1.0)

    def state_dict(self) -> dict[str, Any]:
        """The epoch's position (a collective in split mode: every rank calls it, as Lightning does
        when it saves a checkpoint), and the samples seen."""
        position, epoch, seen = self.callback.position_now(), self.epoch, self.samples_seen
        if position is not None and epoch is not None and not epoch.closed and position.epoch == epoch.index:
            seen += position.samples_done - epoch.done_before  # the epoch's samples so far, all ranks
        state = {"position": position.to_state() if position else None, "samples_seen": seen}
        return {**state, "steps": self.steps_before}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples_seen = int(state.get("samples_seen", 0))
        self.steps_before = int(state.get("steps", 0))
        position = state.get("position")
        self.position = Position.from_state(position, self.manifest.shards("train")) if position else None
        if self.position is not None:
            self.position.check_compatible(self.manifest, self.mode)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, tuple) and len(batch) == 2:
            return tuple(x.to(device, non_blocking=True) for x in batch)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)
