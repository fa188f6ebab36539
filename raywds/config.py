"""One frozen config shared by the CLI, the notebook and the Ray job.

from raywds.config import TrainConfig
cfg = TrainConfig(data="shards/", epochs=3, model="resnet18")
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from raywds.errors import ConfigError
from raywds.fields import flag
from raywds.recipes import RECIPES

# The choices of each setting; the CLI's --help and choices come from these (raywds.flags).
ModeName = Literal["resample", "split"]
Optimizer = Literal["sgd", "adamw"]
Precision = Literal["auto", "bf16", "fp32"]
MemoryFormat = Literal["auto", "channels_last", "contiguous"]
DecodeName = Literal["cpu", "device", "pil"]
TrackerName = Literal["mlflow", "wandb", "tensorboard"]
AutoAugmentName = Literal["ta_wide", "ra", "augmix", "imagenet"]

PROGRESSIVE_STEP_PX = 32
"""--progressive-resize's sizes go up in steps of this many pixels (FFCV's schedule)."""


@dataclass(frozen=True, kw_only=True)
class S3Endpoint:
    """Which store s3:// paths name; every command that reads or writes them takes it."""

    s3_endpoint: str | None = None
    """The S3-compatible store's URL for s3:// paths (MinIO, AIStore, SeaweedFS, R2...); default
    AWS_ENDPOINT_URL, else AWS. Credentials come from boto3's chain (AWS_* variables, ~/.aws, a role)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig(S3Endpoint):
    """Everything a training run needs to know; the world (rank, size) is passed separately."""

    data: str
    """Shards: a folder, manifest.json, an http(s) URL a shard server serves, an s3:// or gs:// prefix, or
    WebDataset shards as you name them (brace list, glob, pipe: template), indexed once on first use."""
    val_data: str | None = None
    """Validation shards named as --data names them (default: --data's shards named *val*/*validation*)."""
    index_cache: str | None = None
    """Where indexes of --data shards without a manifest are kept (default: RAYWDS_INDEX_CACHE, else
    ~/.cache/raywds/index)."""
    shards_at: str | None = None
    """Where the shards are when not beside the manifest: a folder, a base URL, or a template
    with {} for the shard name, e.g. `pipe:aws s3 cp s3://bucket/shards/{} -`. Several base URLs,
    comma-separated, share the shards between servers of the same folder (a shard always from one)."""
    epochs: int = 3
    """Passes over the training split."""
    batch_size: int = 64
    """Samples per batch on each rank; the global batch is this times the number of ranks."""
    model: str = "resnet50"
    """Any `torchvision.models` name, or `demo` for the small CPU network."""
    mode: ModeName = "resample"
    """`resample`: equal batch counts on every rank. `split`: every sample exactly once per epoch."""
    optimizer: Optimizer = "sgd"
    """`sgd` (momentum, nesterov) or `adamw`."""
    lr: float | None = None
    """Peak learning rate; None means 0.1 x global batch / 256 for sgd, 1e-3 for adamw."""
    weight_decay: float = 5e-5
    """Weight decay of the weights (not of norms' parameters and biases: --norm-weight-decay, --bias-weight-decay)."""
    norm_weight_decay: float = 0.0
    """Weight decay of the norm layers' parameters (torchvision's reference applies --weight-decay unless told)."""
    bias_weight_decay: float = 0.0
    """Weight decay of the other layers' biases (torchvision's reference applies --weight-decay unless told)."""
    warmup_epochs: float = 0.5
    """Linear warm-up length before the cosine decay."""
    image_size: int = 224
    """Side of the square crop the model sees, in training and validation (unless --train-crop-size,
    --val-crop-size or --progressive-resize say otherwise)."""
    train_crop_size: int | None = None
    """Side of the training crop (default --image-size)."""
    val_resize_size: int | None = None
    """Validation images' short side is resized to this before the centre crop (default val crop / 0.875)."""
    val_crop_size: int | None = None
    """Side of the validation centre crop (default --image-size)."""
    progressive_resize: str | None = field(default=None, metadata=flag(metavar="MIN:MAX"))
    """Train at MIN px crops first, growing in steps of 32 px to MAX over --progressive-epochs (FFCV's
    progressive resizing: small early epochs decode at a reduced DCT scale); the batch size and lr stay."""
    progressive_epochs: str | None = field(default=None, metadata=flag(metavar="START:END"))
    """With --progressive-resize: MIN up to epoch START, MAX from epoch END on, linear between
    (epochs counted from 1; default 1:--epochs)."""
    crop_scale_min: float = 0.08
    """Smallest area fraction RandomResizedCrop may take for training."""
    label_smoothing: float = 0.0
    """Label smoothing of the training loss (0.1 in the ImageNet recipes)."""
    auto_augment: AutoAugmentName | None = None
    """An augmentation policy applied to each training crop in the loader workers, torchvision's:
    ta_wide (TrivialAugmentWide), ra (RandAugment), augmix (AugMix), imagenet (AutoAugment's)."""
    ra_magnitude: int = 9
    """With --auto-augment ra: RandAugment's magnitude."""
    augmix_severity: int = 3
    """With --auto-augment augmix: AugMix's severity."""
    random_erase: float = 0.0
    """Probability of erasing a random rectangle of each training crop (torchvision's RandomErasing,
    filled with the mean pixel: 0 after normalising)."""
    mixup_alpha: float = 0.0
    """Mix each training batch with itself rolled by one, lambda ~ Beta(alpha, alpha), on the device
    (with --cutmix-alpha: one of the two per batch); 0 is off."""
    cutmix_alpha: float = 0.0
    """Paste a box of each batch's rolled copy into it, its area ~ Beta(alpha, alpha), on the device; 0 is off."""
    model_ema: bool = False
    """Keep an exponential moving average of the weights, validated beside them (val_top1_ema) and
    checkpointed, as torchvision's reference recipe does (raywds.train.ema)."""
    model_ema_steps: int = 32
    """With --model-ema: update the average every this many optimizer steps."""
    model_ema_decay: float = 0.99998
    """With --model-ema: the decay before torchvision's adjustment for global batch, steps and epochs."""
    precision: Precision = "auto"
    """`auto` (bf16 autocast on CUDA, float32 on CPU), `bf16` or `fp32`."""
    memory_format: MemoryFormat = "auto"
    """`auto` (channels_last on CUDA, contiguous on CPU and for `--compile` under 64 px),
    `channels_last` or `contiguous`."""
    compile: bool = False
    """Wrap the model in torch.compile."""
    decode: DecodeName = "cpu"
    """Where training JPEGs are decoded: `cpu` (loader workers, DCT-scaled when the crop allows),
    `device` (workers send bytes; the training device decodes, with nvJPEG on a GPU) or `pil`
    (torchvision's reference PIL transform). See raywds.loader.crops."""
    loader_workers: int | Literal["auto"] = 2
    """DataLoader worker processes on each rank, or `auto`: chosen at each epoch's start from the
    last epoch's decode rate and step time, within the rank's cores (raywds.train.autoworkers)."""
    worker_shuffle_buffer: int = 1000
    """Samples (still encoded) held in each DataLoader worker's shuffle buffer."""
    cross_worker_shuffle_buffer: int = 0
    """Decoded samples held in a shuffle buffer in the main process, mixing the workers' batches; 0 is off."""
    canonical_nodes: int = 0
    """split mode: deal the shards once to this many groups for the whole run, each read by one
    node every epoch (shuffled there), so that with --cache-dir a node fetches its shards once;
    0 deals every shard anew each epoch. A multiple of the node count (raywds.plan.split.node_deal)."""
    batches_per_epoch: int | None = None
    """resample mode: batches per epoch on every rank; None means ceil(N / (ranks x batch))."""
    seed: int = 0
    """Seeds shard choice, shuffles and weight init."""
    out: str = "runs/local"
    """Where checkpoints and metrics go when not running under Ray (runs/demo for --demo)."""
    pg_timeout: int = 300
    """Process-group timeout: a stalled collective becomes an error after this long."""
    loader_timeout: float = 240.0
    """A loader worker that delivers no batch for this long is an error naming the rank, the worker
    and its shard (keep it under --pg-timeout, so the stuck rank says so before the others time out)."""
    read_timeout: float = 60.0
    """Longest wait for the next bytes of a shard before a retry; a stalled server becomes an error."""
    read_retries: int = 3
    """Retries of a failed shard read (backoff 1, 2, 4 s, resuming where it stopped)."""
    cache_dir: str | None = None
    """Keep http and s3 shards on local disk after their first read (for repeated epochs over slow links)."""
    verify_hashes: bool = False
    """Hash each shard while reading it and fail at its end, naming it, when its sha256 differs
    from the manifest's: catches corruption no decoder can see (a flipped bit in pixels or a class)."""
    max_bad_samples: float = 0.001
    """resample mode: samples that cannot be decoded are skipped and counted, up to this many distinct
    ones per epoch (below 1: a fraction of the epoch's samples; each draw of a sample is skipped,
    the sample counts once), then the run stops. Split mode never skips."""
    log_every: float = 60.0
    """Rank 0 prints a progress line (loss, lr, images/s, data wait, ETA) this often inside an epoch."""
    tensorboard: bool = False
    """Rank 0 also writes the epoch and progress rows of metrics.jsonl as TensorBoard scalars to
    RUN_DIR/tensorboard/ (needs the tensorboard extra: pip install 'raywds[tensorboard]')."""
    tracking: list[TrackerName] | None = field(default=None, metadata=flag(append=True))
    """Also send the config and each epoch's (and in-epoch checkpoint's) numbers to these (repeatable): mlflow
    (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME), wandb (WANDB_PROJECT, WANDB_MODE), tensorboard (as --tensorboard);
    one tracking run per training run, through resumes and restarts."""
    tracking_checkpoint: bool = False
    """With --tracking mlflow or wandb: send best/checkpoint.pt as an artifact at the run's end."""
    val_every: int = 1
    """Validate every this many epochs (and always after the last)."""
    checkpoint_every_steps: int | None = None
    """Also checkpoint inside an epoch, every this many steps (at steps every rank reaches)."""
    global_batch: int | None = None
    """Samples each optimizer step sees, on any number of ranks: each rank adds up the gradients
    of global_batch / (ranks x --batch-size) batches a step, so an elastic resize keeps the
    optimisation the same (None: one batch a rank, a step)."""
    notice_every: int | None = 10
    """Every this many steps, every rank asks whether a notice came (Ray's preemption notice, or
    SIGTERM to any rank) and checkpoints on one at once (None: never ask)."""
    max_steps: int | None = None
    """Stop, with a checkpoint, after this many steps in all; a later run with resume goes on."""
    resume: str | None = None
    """A checkpoint (file, or Ray checkpoint directory) to continue from: weights, optimizer and data position."""
    audit_dir: str | None = None
    """Write the id of every sample trained on, per epoch, rank and segment, here (`raywds audit` checks them)."""

    def __post_init__(self) -> None:
        if not self.data:
            raise ConfigError("data is empty: give a shard directory, manifest.json or http URL (--data)")
        for name in ("epochs", "batch_size", "image_size", "pg_timeout", "val_every"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name}={value} must be at least 1")
        for name, allowed in choices().items():
            if getattr(self, name) not in allowed:
                words = ", ".join(a for a in allowed if a is not None)
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {words}")
        for name in self.tracking or []:
            if name not in typing.get_args(TrackerName):
                raise ConfigError(f"tracking={name!r} is not one of {', '.join(typing.get_args(TrackerName))}")
        workers = self.loader_workers
        if workers != "auto" and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
            raise ConfigError(f"loader_workers={workers!r} must be 0 or more, or 'auto'")
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"lr={self.lr} must be positive (or None for the default)")
        if not 0 < self.model_ema_decay < 1 or self.model_ema_steps < 1:
            raise ConfigError(
                f"model_ema_decay={self.model_ema_decay} must lie in (0, 1) and model_ema_steps="
                f"{self.model_ema_steps} be at least 1"
            )
        self._check_augment()
        self._check_sizes()
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"label_smoothing={self.label_smoothing} must lie in [0, 1)")
        if not 0 < self.crop_scale_min <= 1:
            raise ConfigError(f"crop_scale_min={self.crop_scale_min} must lie in (0, 1]")
        if self.warmup_epochs < 0:
            raise ConfigError(f"warmup_epochs={self.warmup_epochs} must be 0 or more")
        if self.max_bad_samples < 0 or (
            self.max_bad_samples >= 1 and self.max_bad_samples != int(self.max_bad_samples)
        ):
            raise ConfigError(
                f"max_bad_samples={self.max_bad_samples} must be a fraction below 1 or a whole number of samples"
            )
        if self.loader_timeout <= 0:
            raise ConfigError(f"loader_timeout={self.loader_timeout} must be positive")
        if self.read_timeout <= 0:
            raise ConfigError(f"read_timeout={self.read_timeout} must be positive")
        for name in ("worker_shuffle_buffer", "cross_worker_shuffle_buffer", "read_retries", "canonical_nodes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be 0 or more")
        if self.global_batch is not None and (self.global_batch < 1 or self.global_batch % self.batch_size):
            raise ConfigError(
                f"--global-batch {self.global_batch} must be a multiple of --batch-size {self.batch_size}"
            )
        for name in ("batches_per_epoch", "checkpoint_every_steps", "notice_every", "max_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be at least 1 (or None)")
        if self.batches_per_epoch is not None and self.mode == "split":
            raise ConfigError("batches_per_epoch applies to resample mode; split mode's epoch is the whole split once")

    def _check_augment(self) -> None:
        if not 0 <= self.random_erase <= 1:
            raise ConfigError(f"random_erase={self.random_erase} must lie in [0, 1]")
        if self.mixup_alpha < 0 or self.cutmix_alpha < 0:
            raise ConfigError(f"mixup_alpha={self.mixup_alpha} and cutmix_alpha={self.cutmix_alpha} must be 0 or more")

    def _check_sizes(self) -> None:
        for name in ("train_crop_size", "val_resize_size", "val_crop_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value} must be at least 1 (or None)")
        if self.val_resize_size is not None and self.val_resize_size < self.val_crop:
            raise ConfigError(f"val_resize_size={self.val_resize_size} is smaller than the val crop ({self.val_crop})")
        if self.progressive_epochs is not None and self.progressive_resize is None:
            raise ConfigError("progressive_epochs applies with progressive_resize (--progressive-resize MIN:MAX)")
        if self.progressive_resize is not None:
            if self.train_crop_size is not None:
                raise ConfigError("--train-crop-size and --progressive-resize both set the training crop: give one")
            _ = self.progression  # parses both: one line on a bad one

    @property
    def progression(self) -> tuple[int, int, float, float] | None:
        """--progressive-resize and --progressive-epochs as (MIN, MAX, START, END), or None."""
        if self.progressive_resize is None:
            return None
        low, high = _pair(self.progressive_resize, "progressive_resize", int)
        start, end = _pair(self.progressive_epochs or f"1:{self.epochs}", "progressive_epochs", float)
        if not PROGRESSIVE_STEP_PX <= low <= high:
            raise ConfigError(
                f"progressive_resize={self.progressive_resize}: MIN:MAX with {PROGRESSIVE_STEP_PX} <= MIN <= MAX"
            )
        if not 1 <= start <= end:
            raise ConfigError(f"progressive_epochs={self.progressive_epochs}: START:END with 1 <= START <= END")
        return low, high, start, end

    def train_size(self, epoch: int) -> int:
        """The training crop's side in epoch `epoch` (from 0): --progressive-resize's schedule
        (FFCV's: linear from MIN at START to MAX at END, in steps of 32 px from MIN), else
        --train-crop-size, else --image-size."""
        ramp = self.progression
        if ramp is None:
            return self.train_crop_size or self.image_size
        low, high, start, end = ramp
        if epoch + 1 >= end:
            return high
        if epoch + 1 <= start:
            return low
        at = low + (high - low) * (epoch + 1 - start) / (end - start)
        return min(high, low + PROGRESSIVE_STEP_PX * round((at - low) / PROGRESSIVE_STEP_PX))

    @property
    def train_sizes(self) -> list[int]:
        """Every epoch's training crop side."""
        return [self.train_size(epoch) for epoch in range(self.epochs)]

    @property
    def val_crop(self) -> int:
        return self.val_crop_size or self.image_size

    @property
    def val_resize(self) -> int:
        """The short side validation images are resized to before the centre crop."""
        return self.val_resize_size or round(self.val_crop / 0.875)

    @property
    def loader_worker_count(self) -> int:
        """The loader workers of each rank; `auto` has a count only once an epoch's start chose it."""
        if self.loader_workers == "auto":
            raise ConfigError("loader_workers='auto' is chosen at each epoch's start: no count yet")
        return self.loader_workers

    def bad_samples_allowed(self, epoch_samples: int) -> int:
        """How many distinct undecodable samples an epoch of `epoch_samples` may skip (resample mode)."""
        if self.max_bad_samples >= 1:
            return int(self.max_bad_samples)
        return int(self.max_bad_samples * epoch_samples)

    def peak_lr(self, world_size: int) -> float:
        """The learning rate at the end of warm-up, scaled by the global batch for sgd."""
        if self.lr is not None:
            return self.lr
        if self.optimizer == "sgd":
            return 0.1 * (self.global_batch or self.batch_size * world_size) / 256
        return 1e-3

    def accumulation(self, world_size: int) -> int:
        """Batches each rank trains an optimizer step on `world_size` ranks (--global-batch)."""
        if self.global_batch is None:
            return 1
        per_step = world_size * self.batch_size
        if self.global_batch % per_step:
            raise ConfigError(
                f"--global-batch {self.global_batch} cannot be reached by {world_size} rank(s) of --batch-size "
                f"{self.batch_size}: make it a multiple of {per_step}"
            )
        return self.global_batch // per_step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def trackers(self) -> list[str]:
        """What rank 0 sends the rows to: --tracking's, and tensorboard for --tensorboard (the older flag)."""
        return list(dict.fromkeys([*(self.tracking or []), *(["tensorboard"] if self.tensorboard else [])]))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        check_known(values, "config")
        return cls(**values)


def _pair(text: str, name: str, kind: type[Any]) -> tuple[Any, Any]:
    """'A:B' as two numbers of `kind`, or one line saying what was expected."""
    try:
        a, b = text.split(":")
        return kind(a), kind(b)
    except ValueError:
        raise ConfigError(f"{name}={text!r} must be two numbers as A:B") from None


def check_known(values: dict[str, Any], where: str) -> None:
    """Refuse keys that are not TrainConfig fields, naming `where` they came from."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where} has unknown keys {unknown}; known keys are {sorted(known)}")


@functools.cache
def choices() -> dict[str, tuple[str | None, ...]]:
    """Each field whose type is a Literal, or a Literal or None, and its allowed values (None among
    them for the second)."""
    hints = typing.get_type_hints(TrainConfig)
    allowed: dict[str, tuple[str | None, ...]] = {}
    for name, hint in hints.items():
        kinds = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        words = [k for k in kinds if k is not type(None)]
        if len(words) == 1 and typing.get_origin(words[0]) is Literal:
            allowed[name] = (*typing.get_args(words[0]), *((None,) if len(kinds) > 1 else ()))
    return allowed


def read_config_file(path: str) -> dict[str, Any]:
    """TrainConfig fields from a .json or .toml file."""
    import json
    from pathlib import Path

    where = Path(path)
    try:
        text = where.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        if where.suffix == ".toml":
            import tomllib

            values: dict[str, Any] = tomllib.loads(text)
        else:
            values = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"config file {path} does not parse: {e}") from None
    check_known(values, f"config file {path}")
    return values


def resolve(data: str, *, recipe: str | None = None, config_file: str | None = None, **flags: Any) -> TrainConfig:
    """The run's config: the recipe, then the config file, then flags (None means not given)."""
    values: dict[str, Any] = {}
    if recipe is not None:
        if recipe not in RECIPES:
            raise ConfigError(f"unknown recipe {recipe!r}; recipes are {', '.join(RECIPES)}")
        values.update(RECIPES[recipe])
    if config_file is not None:
        values.update(read_config_file(config_file))
    values.update({k: v for k, v in flags.items() if v is not None})
    values["data"] = data
    return TrainConfig(**values)


def demo_config(data: str, **overrides: Any) -> TrainConfig:
    """The demo recipe, with `overrides`."""
    return resolve(data, recipe="demo", **overrides)
