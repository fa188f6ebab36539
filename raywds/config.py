"""One frozen config shared by the CLI, the notebook and the Ray job, composed of the sections its
parts declare and check: where the shards are (raywds.data.source.Source), the epoch's plan
(raywds.plan.modes.Schedule) and how the loader reads and crops (raywds.loader.settings.Loading),
with the rest of a run's settings beside them.

from raywds.config import TrainConfig
cfg = TrainConfig(data="shards/", epochs=3, model="resnet18")
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from raywds.data.source import Source
from raywds.errors import ConfigError
from raywds.fields import MAX_SECONDS, MAX_STEPS, PATH, PLACE, TEXT, URL, check_values, flag
from raywds.loader.settings import MAX_SIDE, LoaderConfig, Loading
from raywds.plan.modes import Schedule
from raywds.recipes import RECIPES

# The choices of each setting; the CLI's --help and choices come from these (raywds.flags).
Optimizer = Literal["sgd", "adamw"]
Precision = Literal["auto", "bf16", "fp32"]
MemoryFormat = Literal["auto", "channels_last", "contiguous"]
TrackerName = Literal["mlflow", "wandb", "tensorboard"]

PROGRESSIVE_STEP_PX = 32
"""--progressive-resize's sizes go up in steps of this many pixels (FFCV's schedule)."""
MAX_EPOCHS = 100_000


@dataclass(frozen=True)
class Progression:
    """Progressive resizing (FFCV's schedule): crops of `low` px up to epoch `start`, `high` from
    epoch `end` on (epochs counted from 1), linear between in steps of PROGRESSIVE_STEP_PX from `low`."""

    low: int
    high: int
    start: float
    end: float

    @classmethod
    def parse(cls, sizes: str, epochs: str) -> Progression:
        """--progressive-resize MIN:MAX and --progressive-epochs START:END, or one line on a bad one."""
        low, high = _pair(sizes, "progressive_resize", int)
        start, end = _pair(epochs, "progressive_epochs", float)
        if not PROGRESSIVE_STEP_PX <= low <= high <= MAX_SIDE:
            raise ConfigError(
                f"progressive_resize={sizes}: MIN:MAX with {PROGRESSIVE_STEP_PX} <= MIN <= MAX <= {MAX_SIDE}"
            )
        if not 1 <= start <= end <= MAX_EPOCHS:
            raise ConfigError(f"progressive_epochs={epochs}: START:END with 1 <= START <= END")
        return cls(low, high, start, end)

    def size(self, epoch: int) -> int:
        """The crop side in epoch `epoch` (from 0)."""
        if epoch + 1 >= self.end:
            return self.high
        if epoch + 1 <= self.start:
            return self.low
        at = self.low + (self.high - self.low) * (epoch + 1 - self.start) / (self.end - self.start)
        return min(self.high, self.low + PROGRESSIVE_STEP_PX * round((at - self.low) / PROGRESSIVE_STEP_PX))


@dataclass(frozen=True, kw_only=True)
class S3Endpoint:
    """Which store s3:// paths name; every command that reads or writes them takes it."""

    s3_endpoint: str | None = field(default=None, metadata=flag(form=URL))
    """The S3-compatible store's URL for s3:// paths (MinIO, AIStore, SeaweedFS, R2...); default
    AWS_ENDPOINT_URL, else AWS. Credentials come from boto3's chain (AWS_* variables, ~/.aws, a role)."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig(Source, Schedule, Loading):
    """Everything a training run needs to know: its parts' sections (Source, Schedule, Loading) and the
    settings below; the world (rank, size) is passed separately."""

    epochs: int = field(default=3, metadata=flag(minimum=1, maximum=MAX_EPOCHS))
    """Passes over the training split."""
    model: str = field(default="resnet50", metadata=flag(form=TEXT))
    """A torchvision model (resnet50; with a weights tag: resnet50.IMAGENET1K_V2), a timm model as the
    Hugging Face Hub names it (timm/convnext_tiny.fb_in22k; needs raywds[timm]), or `demo` for the small CPU network."""
    pretrained: bool = False
    """Start from the weights --model's library publishes for it (torchvision's default or the tag's;
    timm's tag), read through that library's cache (TORCH_HOME, HF_HOME; HF_HUB_OFFLINE=1 works offline)."""
    initial_checkpoint: str | None = field(default=None, metadata=flag(form=PLACE))
    """Start from these weights: a .safetensors or .pth/.pt state dict, or a raywds run or checkpoint
    (its weights and EMA only), at a path or an s3://, gs:// or http(s):// URL; --resume continues a run instead."""
    layer_decay: float | None = field(default=None, metadata=flag(above=0, maximum=1))
    """Scale each layer group's learning rate by this to the power of its depth below the classifier
    (timm's --layer-decay, e.g. 0.75 for ViT fine-tuning); None leaves every group at the peak lr."""
    freeze_epochs: int = field(default=0, metadata=flag(minimum=0, maximum=MAX_EPOCHS))
    """Train only the classifier for the first this many epochs (every other tensor frozen, BatchNorm
    statistics too), then the whole model."""
    optimizer: Optimizer = "sgd"
    """`sgd` (momentum, nesterov) or `adamw`."""
    lr: float | None = field(default=None, metadata=flag(above=0, maximum=100))
    """Peak learning rate; None means 0.1 x global batch / 256 for sgd, 1e-3 for adamw."""
    weight_decay: float = field(default=5e-5, metadata=flag(minimum=0, maximum=1))
    """Weight decay of the weights (not of norms' parameters and biases: --norm-weight-decay, --bias-weight-decay)."""
    norm_weight_decay: float = field(default=0.0, metadata=flag(minimum=0, maximum=1))
    """Weight decay of the norm layers' parameters (torchvision's reference applies --weight-decay unless told)."""
    bias_weight_decay: float = field(default=0.0, metadata=flag(minimum=0, maximum=1))
    """Weight decay of the other layers' biases (torchvision's reference applies --weight-decay unless told)."""
    warmup_epochs: float = field(default=0.5, metadata=flag(minimum=0, maximum=MAX_EPOCHS))
    """Linear warm-up length before the cosine decay."""
    label_smoothing: float = field(default=0.0, metadata=flag(minimum=0, below=1))
    """Label smoothing of the training loss (0.1 in the ImageNet recipes)."""
    mixup_alpha: float = field(default=0.0, metadata=flag(minimum=0, maximum=100))
    """Mix each training batch with itself rolled by one, lambda ~ Beta(alpha, alpha), on the device
    (with --cutmix-alpha: one of the two per batch); 0 is off."""
    cutmix_alpha: float = field(default=0.0, metadata=flag(minimum=0, maximum=100))
    """Paste a box of each batch's rolled copy into it, its area ~ Beta(alpha, alpha), on the device; 0 is off."""
    model_ema: bool = False
    """Keep an exponential moving average of the weights, validated beside them (val_top1_ema) and
    checkpointed, as torchvision's reference recipe does (raywds.train.ema)."""
    model_ema_steps: int = field(default=32, metadata=flag(minimum=1, maximum=MAX_STEPS))
    """With --model-ema: update the average every this many optimizer steps."""
    model_ema_decay: float = field(default=0.99998, metadata=flag(above=0, below=1))
    """With --model-ema: the decay before torchvision's adjustment for global batch, steps and epochs."""
    precision: Precision = "auto"
    """`auto` (bf16 autocast on CUDA, float32 on CPU), `bf16` or `fp32`."""
    memory_format: MemoryFormat = "auto"
    """`auto` (channels_last on CUDA, contiguous on CPU and for `--compile` under 64 px),
    `channels_last` or `contiguous`."""
    compile: bool = False
    """Wrap the model in torch.compile."""
    out: str = field(default="runs/local", metadata=flag(form=PATH))
    """Where checkpoints and metrics go when not running under Ray (runs/demo for --demo)."""
    pg_timeout: int = field(default=300, metadata=flag(minimum=1, maximum=MAX_SECONDS))
    """Process-group timeout: a stalled collective becomes an error after this long."""
    max_bad_samples: float = field(default=0.001, metadata=flag(minimum=0, maximum=MAX_STEPS))
    """resample mode: samples that cannot be decoded are skipped and counted, up to this many distinct
    ones per epoch (below 1: a fraction of the epoch's samples; each draw of a sample is skipped,
    the sample counts once), then the run stops. Split mode never skips."""
    log_every: float = field(default=60.0, metadata=flag(minimum=0, maximum=MAX_SECONDS))
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
    val_every: int = field(default=1, metadata=flag(minimum=1, maximum=MAX_EPOCHS))
    """Validate every this many epochs (and always after the last)."""
    checkpoint_every_steps: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_STEPS))
    """Also checkpoint inside an epoch, every this many steps (at steps every rank reaches)."""
    global_batch: int | None = field(default=None, metadata=flag(minimum=1, maximum=2**24))
    """Samples each optimizer step sees, on any number of ranks: each rank adds up the gradients
    of global_batch / (ranks x --batch-size) batches a step, so an elastic resize keeps the
    optimisation the same (None: one batch a rank, a step)."""
    notice_every: int | None = field(default=10, metadata=flag(minimum=1, maximum=MAX_STEPS))
    """Every this many steps, every rank asks whether a notice came (Ray's preemption notice, or
    SIGTERM to any rank) and checkpoints on one at once (None: never ask)."""
    max_steps: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_STEPS))
    """Stop, with a checkpoint, after this many steps in all; a later run with resume goes on."""
    resume: str | None = field(default=None, metadata=flag(form=PLACE))
    """A checkpoint (file, or Ray checkpoint directory) to continue from: weights, optimizer and data position."""
    audit_dir: str | None = field(default=None, metadata=flag(form=PATH))
    """Write the id of every sample trained on, per epoch, rank and segment, here (`raywds audit` checks them)."""

    def __post_init__(self) -> None:
        for section in SECTIONS:
            section.__post_init__(self)  # each part checks its own section
        check_values(TrainConfig, {name: getattr(self, name) for name in own_fields()})  # as declared below
        self._check_sizes()
        self._check_start()
        if self.max_bad_samples >= 1 and self.max_bad_samples != int(self.max_bad_samples):
            raise ConfigError(
                f"max_bad_samples={self.max_bad_samples} must be a fraction below 1 or a whole number of samples"
            )
        if self.global_batch is not None and self.global_batch % self.batch_size:
            raise ConfigError(
                f"--global-batch {self.global_batch} must be a multiple of --batch-size {self.batch_size}"
            )

    def _check_start(self) -> None:
        """The starting weights' settings across fields (each field's own range is declared with it)."""
        if self.pretrained and self.initial_checkpoint:
            raise ConfigError("--pretrained and --initial-checkpoint both give starting weights: give one")
        if self.freeze_epochs >= self.epochs:
            raise ConfigError(
                f"freeze_epochs={self.freeze_epochs} leaves no epoch of the {self.epochs} to train the whole model: "
                f"give --freeze-epochs below --epochs (e.g. {max(self.epochs // 3, 0)})"
            )

    def _check_sizes(self) -> None:
        if self.progressive_epochs is not None and self.progressive_resize is None:
            raise ConfigError("progressive_epochs applies with progressive_resize (--progressive-resize MIN:MAX)")
        if self.progressive_resize is not None:
            if self.train_crop_size is not None:
                raise ConfigError("--train-crop-size and --progressive-resize both set the training crop: give one")
            _ = self.progression  # parses both: one line on a bad one

    @functools.cached_property
    def progression(self) -> Progression | None:
        """--progressive-resize and --progressive-epochs, parsed once (None without them)."""
        if self.progressive_resize is None:
            return None
        return Progression.parse(self.progressive_resize, self.progressive_epochs or f"1:{self.epochs}")

    def validates(self, epoch: int) -> bool:
        """Whether epoch `epoch` (from 1) ends in a validation: every --val-every, and the last."""
        return epoch % self.val_every == 0 or epoch == self.epochs

    def train_size(self, epoch: int) -> int:
        """The training crop's side in epoch `epoch` (from 0): --progressive-resize's schedule,
        else --train-crop-size, else --image-size."""
        if self.progression is not None:
            return self.progression.size(epoch)
        return self.train_crop_size or self.image_size

    def loader(self, epoch: int = 0) -> LoaderConfig:
        """The loader's config in epoch `epoch` (from 0: its training crop size), from the sections it reads."""
        return LoaderConfig.of(self, self, self, crop_size=self.train_size(epoch))

    @property
    def train_sizes(self) -> list[int]:
        """Every epoch's training crop side."""
        return [self.train_size(epoch) for epoch in range(self.epochs)]

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


SECTIONS = (Source, Schedule, Loading)
"""The parts' sections the training config is composed of, each declared and checked by its part."""


@functools.cache
def own_fields() -> tuple[str, ...]:
    """The training config's fields that no part's section declares."""
    sectioned = {f.name for section in SECTIONS for f in dataclasses.fields(section)}
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in sectioned)


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
