"""The loader's own config: the slice of the run's TrainConfig that the per-rank loader and the
Ray Data plane read (20 fields: the crop sizes resolved for the epoch, the rest as TrainConfig has
them), built once per epoch by whoever trains (the trainer, the
Lightning DataModule), as torchtitan hands each component its own config. The fields keep
TrainConfig's names, so `--batch-size` is `batch_size` in both.

    loader_cfg = LoaderConfig.of(cfg)      # cfg: TrainConfig, its loader workers already a number
    train_loader(manifest, loader_cfg, world, plan, epoch=0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from raywds.config import TrainConfig
from raywds.errors import ConfigError
from raywds.loader.augment import Augment
from raywds.loader.decodings import decoding
from raywds.loader.readers import ReadPolicy
from raywds.plan.modes import loader_slots


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    batch_size: int
    loader_workers: int
    """DataLoader worker processes (0: the training process reads); `auto` is resolved before."""
    image_size: int
    """The training crop's side this epoch (raywds.config.TrainConfig.train_size)."""
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
    def of(cls, cfg: TrainConfig, epoch: int = 0) -> LoaderConfig:
        """`cfg`'s slice for the loader in epoch `epoch` (from 0: its training crop size)."""
        if Augment.of(cfg) is not None and not decoding(cfg.decode).in_workers:
            raise ConfigError(
                "--auto-augment and --random-erase change the decoded crop in the loader workers: "
                f"use --decode cpu or pil with them, not {cfg.decode}"
            )
        sizes: dict[str, Any] = dict(
            image_size=cfg.train_size(epoch), val_crop_size=cfg.val_crop, val_resize_size=cfg.val_resize
        )
        names = [f.name for f in dataclasses.fields(cls) if f.name not in {"loader_workers", *sizes}]
        return cls(loader_workers=cfg.loader_worker_count, **sizes, **{name: getattr(cfg, name) for name in names})

    @property
    def validating(self) -> LoaderConfig:
        """This slice for a validation pass: its images are the val crop's size."""
        return dataclasses.replace(self, image_size=self.val_crop_size)

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
