"""The loader's section of a run's config (`Loading`: how images are read, decoded, cropped,
augmented and normalised, declared and checked here), and the loader's own config for a pass
(`LoaderConfig`: 20 fields, the crop sizes resolved for the epoch, the rest as the run's sections
have them), built once per epoch by whoever trains (the trainer, the Lightning DataModule), as
torchtitan hands each component its own config. The training config (raywds.train.config.TrainConfig)
is composed of the sections, which the loader does not import. The fields keep the config's
names, so `--batch-size` is `batch_size` in both.

    loader_cfg = cfg.loader(epoch=0)       # cfg: a TrainConfig, its loader workers a number
    train_loader(manifest, loader_cfg, world, plan, epoch=0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from raywds.data.http import ReadPolicy
from raywds.data.source import Source
from raywds.errors import ConfigError
from raywds.fields import MAX_SECONDS, PAIR, PATH, RGB, check_fields, flag
from raywds.plan.modes import Schedule, loader_slots

if TYPE_CHECKING:
    from raywds.loader.decodings import Decoding

DecodeName = Literal["cpu", "device", "pil"]
AutoAugmentName = Literal["ta_wide", "ra", "augmix", "imagenet"]
MAX_SIDE = 8192
"""The largest crop or resize side, in px, a setting takes."""


@dataclass(frozen=True, kw_only=True)
class Loading:
    """The loader section of a run's config: how its images are read, decoded, cropped, augmented
    and normalised. The loader part declares and checks it; the training config
    (raywds.train.config.TrainConfig) is composed of it and builds each epoch's LoaderConfig from it."""

    mean: str | None = field(default=None, metadata=flag(metavar="R,G,B", form=RGB))
    """The per-channel mean images are normalised with, on a 0-1 scale (default: the weights' own
    with --pretrained or --initial-checkpoint, else ImageNet's 0.485,0.456,0.406)."""
    std: str | None = field(default=None, metadata=flag(metavar="R,G,B", form=RGB))
    """The per-channel standard deviation (default: the weights' own, else ImageNet's 0.229,0.224,0.225)."""
    crop_pct: float | None = field(default=None, metadata=flag(above=0, maximum=1))
    """The validation centre crop over the resized short side (default: the weights' own, else 0.875;
    --val-resize-size, where given, decides instead)."""
    image_size: int = field(default=224, metadata=flag(minimum=1, maximum=MAX_SIDE))
    """Side of the square crop the model sees, in training and validation (unless --train-crop-size,
    --val-crop-size or --progressive-resize say otherwise)."""
    train_crop_size: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_SIDE))
    """Side of the training crop (default --image-size)."""
    val_resize_size: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_SIDE))
    """Validation images' short side is resized to this before the centre crop (default val crop / 0.875)."""
    val_crop_size: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_SIDE))
    """Side of the validation centre crop (default --image-size)."""
    progressive_resize: str | None = field(default=None, metadata=flag(metavar="MIN:MAX", form=PAIR))
    """Train at MIN px crops first, growing in steps of 32 px to MAX over --progressive-epochs (FFCV's
    progressive resizing: small early epochs decode at a reduced DCT scale); the batch size and lr stay."""
    progressive_epochs: str | None = field(default=None, metadata=flag(metavar="START:END", form=PAIR))
    """With --progressive-resize: MIN up to epoch START, MAX from epoch END on, linear between
    (epochs counted from 1; default 1:--epochs)."""
    crop_scale_min: float = field(default=0.08, metadata=flag(above=0, maximum=1))
    """Smallest area fraction RandomResizedCrop may take for training."""
    auto_augment: AutoAugmentName | None = None
    """An augmentation policy applied to each training crop in the loader workers, torchvision's:
    ta_wide (TrivialAugmentWide), ra (RandAugment), augmix (AugMix), imagenet (AutoAugment's)."""
    ra_magnitude: int = field(default=9, metadata=flag(minimum=0, maximum=30))
    """With --auto-augment ra: RandAugment's magnitude (one of its 31 bins)."""
    augmix_severity: int = field(default=3, metadata=flag(minimum=1, maximum=10))
    """With --auto-augment augmix: AugMix's severity."""
    random_erase: float = field(default=0.0, metadata=flag(minimum=0, maximum=1))
    """Probability of erasing a random rectangle of each training crop (torchvision's RandomErasing,
    filled with the mean pixel: 0 after normalising)."""
    decode: DecodeName = "cpu"
    """Where training JPEGs are decoded: `cpu` (loader workers, DCT-scaled when the crop allows),
    `device` (workers send bytes; the training device decodes, with nvJPEG on a GPU) or `pil`
    (torchvision's reference PIL transform). See raywds.loader.crops."""
    loader_timeout: float = field(default=240.0, metadata=flag(above=0, maximum=MAX_SECONDS))
    """A loader worker that delivers no batch for this long is an error naming the rank, the worker
    and its shard (keep it under --pg-timeout, so the stuck rank says so before the others time out)."""
    read_timeout: float = field(default=60.0, metadata=flag(above=0, maximum=MAX_SECONDS))
    """Longest wait for the next bytes of a shard before a retry; a stalled server becomes an error."""
    read_retries: int = field(default=3, metadata=flag(minimum=0, maximum=100))
    """Retries of a failed shard read (backoff 1, 2, 4 s, resuming where it stopped)."""
    cache_dir: str | None = field(default=None, metadata=flag(form=PATH))
    """Keep http and s3 shards on local disk after their first read (for repeated epochs over slow links)."""
    verify_hashes: bool = False
    """Hash each shard while reading it and fail at its end, naming it, when its sha256 differs
    from the manifest's: catches corruption no decoder can see (a flipped bit in pixels or a class)."""

    def __post_init__(self) -> None:
        check_fields(self, Loading)  # each field's type, choices, range and form, as declared above
        if self.val_resize_size is not None and self.val_resize_size < self.val_crop:
            raise ConfigError(f"val_resize_size={self.val_resize_size} is smaller than the val crop ({self.val_crop})")
        if self.augments and not self.decoding.in_workers:
            raise ConfigError(
                "--auto-augment and --random-erase change the decoded crop in the loader workers: "
                f"use --decode cpu or pil with them, not {self.decode}"
            )

    @property
    def val_crop(self) -> int:
        return self.val_crop_size or self.image_size

    @property
    def val_resize(self) -> int:
        """The short side validation images are resized to before the centre crop."""
        return self.val_resize_size or round(self.val_crop / (self.crop_pct or 0.875))

    @property
    def augments(self) -> bool:
        """Whether the loader workers augment the decoded crop."""
        return augments(self)

    @property
    def decoding(self) -> Decoding:
        """The decoding --decode names, imported where first asked: the decoders import torch, which
        the command line (`raywds convert`, `raywds --help`) does without."""
        from raywds.loader.decodings import decoding

        return decoding(self.decode)

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """--mean and --std as numbers (ImageNet's where not set)."""
        return rgb(self.mean, "mean", (0.485, 0.456, 0.406)), rgb(self.std, "std", (0.229, 0.224, 0.225))


def augments(cfg: Loading | LoaderConfig) -> bool:
    """Whether a run's loader section, or a pass's loader config, asks for augmentations of the
    decoded crop (--auto-augment, --random-erase): raywds.loader.augment.Augment.of builds them."""
    return cfg.auto_augment is not None or bool(cfg.random_erase)


def rgb(text: str | None, name: str, default: tuple[float, float, float]) -> tuple[float, float, float]:
    """An R,G,B setting's three numbers (`default` where it is not set), or one line on a bad one."""
    if text is None:
        return default
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(0 <= v <= 1 for v in values) or (name == "std" and 0 in values):
        raise ConfigError(
            f"{name}={text!r} must be three numbers R,G,B on a 0-1 scale (e.g. {','.join(map(str, default))})"
        )
    r, g, b = values
    return r, g, b


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
    def of(cls, loading: Loading, schedule: Schedule, source: Source, *, crop_size: int) -> LoaderConfig:
        """The loader's config for a pass of `crop_size` px training crops, from the sections it
        reads (a training config is all three: TrainConfig.loader)."""
        return cls(
            batch_size=schedule.batch_size,
            loader_workers=schedule.loader_worker_count,
            crop_size=crop_size,
            val_crop_size=loading.val_crop,
            val_resize_size=loading.val_resize,
            crop_scale_min=loading.crop_scale_min,
            decode=loading.decode,
            seed=schedule.seed,
            worker_shuffle_buffer=schedule.worker_shuffle_buffer,
            cross_worker_shuffle_buffer=schedule.cross_worker_shuffle_buffer,
            loader_timeout=loading.loader_timeout,
            read_timeout=loading.read_timeout,
            read_retries=loading.read_retries,
            cache_dir=loading.cache_dir,
            s3_endpoint=source.s3_endpoint,
            verify_hashes=loading.verify_hashes,
            auto_augment=loading.auto_augment,
            ra_magnitude=loading.ra_magnitude,
            augmix_severity=loading.augmix_severity,
            random_erase=loading.random_erase,
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
