"""The loader's own config: the section of a run's config that the per-rank loader and the Ray
Data plane read (20 fields: the crop sizes resolved for the epoch, the rest as the run's config
has them), built once per epoch by whoever trains (the trainer, the Lightning DataModule), as
torchtitan hands each component its own config. `Loading` says what it is built from: the
training config (raywds.config.TrainConfig) is one, which the loader does not import. The fields
keep the config's names, so `--batch-size` is `batch_size` in both.

    loader_cfg = LoaderConfig.of(cfg)      # cfg: a Loading (TrainConfig), its loader workers a number
    train_loader(manifest, loader_cfg, world, plan, epoch=0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from raywds.errors import ConfigError
from raywds.loader.augment import Augment
from raywds.loader.decodings import decoding
from raywds.loader.readers import ReadPolicy
from raywds.plan.modes import loader_slots


class Loading(Protocol):
    """What the loader's section is built from: a run's config (raywds.config.TrainConfig is one)."""

    @property
    def batch_size(self) -> int: ...
    @property
    def loader_worker_count(self) -> int: ...
    def train_size(self, epoch: int) -> int: ...
    @property
    def val_crop(self) -> int: ...
    @property
    def val_resize(self) -> int: ...
    @property
    def crop_scale_min(self) -> float: ...
    @property
    def decode(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def worker_shuffle_buffer(self) -> int: ...
    @property
    def cross_worker_shuffle_buffer(self) -> int: ...
    @property
    def loader_timeout(self) -> float: ...
    @property
    def read_timeout(self) -> float: ...
    @property
    def read_retries(self) -> int: ...
    @property
    def cache_dir(self) -> str | None: ...
    @property
    def s3_endpoint(self) -> str | None: ...
    @property
    def verify_hashes(self) -> bool: ...
    @property
    def auto_augment(self) -> str | None: ...
    @property
    def ra_magnitude(self) -> int: ...
    @property
    def augmix_severity(self) -> int: ...
    @property
    def random_erase(self) -> float: ...


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    batch_size: int
    loader_workers: int
    """DataLoader worker processes (0: the training process reads); `auto` is resolved before."""
    crop_size: int
    """The side of the crops this pass makes: the training crop's this epoch (the run config's
    train_size), or the val crop's in a validation pass (`validating`)."""
    val_crop_size: int
    val_resize_size: int
    crop_scale_min: float
    decode: str
    """The --decode name (raywds.loader.decodings parses it where a worker decodes)."""
    seed: int
    worker_shuffle_buffer: int
    cross_worker_shuffle_buffer: int
    loader_timeout: float
    read_timeout: float
    read_retries: int
    cache_dir: str | None
    s3_endpoint: str | None
    verify_hashes: bool
    auto_augment: str | None = None
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0

    @classmethod
    def of(cls, cfg: Loading, epoch: int = 0) -> LoaderConfig:
        """`cfg`'s section for the loader in epoch `epoch` (from 0: its training crop size)."""
        if Augment.of(cfg) is not None and not decoding(cfg.decode).in_workers:
            raise ConfigError(
                "--auto-augment and --random-erase change the decoded crop in the loader workers: "
                f"use --decode cpu or pil with them, not {cfg.decode}"
            )
        return cls(
            batch_size=cfg.batch_size,
            loader_workers=cfg.loader_worker_count,
            crop_size=cfg.train_size(epoch),
            val_crop_size=cfg.val_crop,
            val_resize_size=cfg.val_resize,
            crop_scale_min=cfg.crop_scale_min,
            decode=cfg.decode,
            seed=cfg.seed,
            worker_shuffle_buffer=cfg.worker_shuffle_buffer,
            cross_worker_shuffle_buffer=cfg.cross_worker_shuffle_buffer,
            loader_timeout=cfg.loader_timeout,
            read_timeout=cfg.read_timeout,
            read_retries=cfg.read_retries,
            cache_dir=cfg.cache_dir,
            s3_endpoint=cfg.s3_endpoint,
            verify_hashes=cfg.verify_hashes,
            auto_augment=cfg.auto_augment,
            ra_magnitude=cfg.ra_magnitude,
            augmix_severity=cfg.augmix_severity,
            random_erase=cfg.random_erase,
        )

    @property
    def validating(self) -> LoaderConfig:
        """This slice for a validation pass: its images are the val crop's size."""
        return dataclasses.replace(self, crop_size=self.val_crop_size)

    @property
    def slots(self) -> int:
        """Slots per rank: its DataLoader workers, or 1 when the training process reads."""
        return loader_slots(self.loader_workers)

    def read_policy(self, *, skip_unreadable: bool) -> ReadPolicy:
        """Exact passes (split, validation) raise on a shard that stays unreadable; resample skips it."""
        return ReadPolicy(
            read_timeout_s=self.read_timeout,
            retries=self.read_retries,
            skip_unreadable=skip_unreadable,
            cache_dir=self.cache_dir,
            s3_endpoint=self.s3_endpoint,
        )
