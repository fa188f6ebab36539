"""One frozen config shared by the CLI, the notebook and the Ray job.

from raywds.config import TrainConfig
cfg = TrainConfig(data="shards/", epochs=3, model="resnet18")
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from raywds.errors import ConfigError
from raywds.fields import MAX_SEED, PAIR, PATH, PLACE, RGB, SHARDS, TEXT, URL, flag, problem, shown
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
MAX_SIDE = 8192
"""The largest crop or resize side, in px, a setting takes."""
MAX_EPOCHS = 100_000
MAX_STEPS = 10**9
MAX_SECONDS = 10**6
"""The longest timeout a setting takes (11.6 days)."""


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
class TrainConfig(S3Endpoint):
    """Everything a training run needs to know; the world (rank, size) is passed separately."""

    data: str
    """Shards: a folder, manifest.json, an http(s) URL a shard server serves, an s3:// or gs:// prefix, or
    WebDataset shards as you name them (brace list, glob, pipe: template), indexed once on first use."""
    val_data: str | None = field(default=None, metadata=flag(form=SHARDS))
    """Validation shards, named as --data names them: a folder, manifest.json, an http(s) URL, an s3:// or gs://
    prefix, a brace list, a glob or a pipe: template (default: --data's shards named *val*/*validation*)."""
    index_cache: str | None = field(default=None, metadata=flag(form=PATH))
    """Where indexes of --data shards without a manifest are kept (default: RAYWDS_INDEX_CACHE, else
    ~/.cache/raywds/index)."""
    shards_at: str | None = field(default=None, metadata=flag(form=PLACE))
    """Where the shards are when not beside the manifest: a folder, a base URL, or a template
    with {} for the shard name, e.g. `pipe:aws s3 cp s3://bucket/shards/{} -`. Several base URLs,
    comma-separated, share the shards between servers of the same folder (a shard always from one)."""
    epochs: int = field(default=3, metadata=flag(minimum=1, maximum=MAX_EPOCHS))
    """Passes over the training split."""
    batch_size: int = field(default=64, metadata=flag(minimum=1, maximum=65_536))
    """Samples per batch on each rank; the global batch is this times the number of ranks."""
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
    mean: str | None = field(default=None, metadata=flag(metavar="R,G,B", form=RGB))
    """The per-channel mean images are normalised with, on a 0-1 scale (default: the weights' own
    with --pretrained or --initial-checkpoint, else ImageNet's 0.485,0.456,0.406)."""
    std: str | None = field(default=None, metadata=flag(metavar="R,G,B", form=RGB))
    """The per-channel standard deviation (default: the weights' own, else ImageNet's 0.229,0.224,0.225)."""
    crop_pct: float | None = field(default=None, metadata=flag(above=0, maximum=1))
    """The validation centre crop over the resized short side (default: the weights' own, else 0.875;
    --val-resize-size, where given, decides instead)."""
    mode: ModeName = "resample"
    """`resample`: equal batch counts on every rank. `split`: every sample exactly once per epoch."""
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
    label_smoothing: float = field(default=0.0, metadata=flag(minimum=0, below=1))
    """Label smoothing of the training loss (0.1 in the ImageNet recipes)."""
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
    decode: DecodeName = "cpu"
    """Where training JPEGs are decoded: `cpu` (loader workers, DCT-scaled when the crop allows),
    `device` (workers send bytes; the training device decodes, with nvJPEG on a GPU) or `pil`
    (torchvision's reference PIL transform). See raywds.loader.crops."""
    loader_workers: int | Literal["auto"] = field(default=2, metadata=flag(minimum=0, maximum=512))
    """DataLoader worker processes on each rank, or `auto`: chosen at each epoch's start from the
    last epoch's decode rate and step time, within the rank's cores (raywds.train.autoworkers)."""
    worker_shuffle_buffer: int = field(default=1000, metadata=flag(minimum=0, maximum=10**6))
    """Samples (still encoded) held in each DataLoader worker's shuffle buffer."""
    cross_worker_shuffle_buffer: int = field(default=0, metadata=flag(minimum=0, maximum=10**6))
    """Decoded samples held in a shuffle buffer in the main process, mixing the workers' batches; 0 is off."""
    canonical_nodes: int = field(default=0, metadata=flag(minimum=0, maximum=100_000))
    """split mode: deal the shards once to this many groups for the whole run, each read by one
    node every epoch (shuffled there), so that with --cache-dir a node fetches its shards once;
    0 deals every shard anew each epoch. A multiple of the node count (raywds.plan.split.node_deal)."""
    batches_per_epoch: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_STEPS))
    """resample mode: batches per epoch on every rank; None means ceil(N / (ranks x batch))."""
    seed: int = field(default=0, metadata=flag(minimum=0, maximum=MAX_SEED))
    """Seeds shard choice, shuffles and weight init."""
    out: str = field(default="runs/local", metadata=flag(form=PATH))
    """Where checkpoints and metrics go when not running under Ray (runs/demo for --demo)."""
    pg_timeout: int = field(default=300, metadata=flag(minimum=1, maximum=MAX_SECONDS))
    """Process-group timeout: a stalled collective becomes an error after this long."""
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
        if not self.data:
            raise ConfigError("data is empty: give a shard directory, manifest.json or http URL (--data)")
        check_fields(self)  # each field's type, choices, range and form, as declared above
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
        if self.batches_per_epoch is not None and self.mode == "split":
            raise ConfigError("batches_per_epoch applies to resample mode; split mode's epoch is the whole split once")

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
        if self.val_resize_size is not None and self.val_resize_size < self.val_crop:
            raise ConfigError(f"val_resize_size={self.val_resize_size} is smaller than the val crop ({self.val_crop})")
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
        return self.val_resize_size or round(self.val_crop / (self.crop_pct or 0.875))

    def normalisation(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """--mean and --std as numbers (ImageNet's where not set)."""
        return _triple(self.mean, "mean", (0.485, 0.456, 0.406)), _triple(self.std, "std", (0.229, 0.224, 0.225))

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


def _triple(text: str | None, name: str, default: tuple[float, ...]) -> tuple[float, ...]:
    """An R,G,B setting's three numbers."""
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
    return values


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
def hints(cls: type) -> dict[str, Any]:
    """The dataclass `cls`'s fields' types (typing.get_type_hints, once a class)."""
    return typing.get_type_hints(cls)


def check_values(cls: type, values: dict[str, Any], *, flags: bool = False) -> None:
    """Refuse the first of `values` (fields of the dataclass `cls` by name; None where not given)
    that its field's declaration does not admit (raywds.fields: type, choices, range, form), in
    one line naming the setting, the value and what it takes: as the flag says it with `flags`
    (`--ra-magnitude 40 must be at most 30 (from 0 to 30)`), else as the field does (`ra_magnitude=40 ...`)."""
    types_ = hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in values or (flags and values[f.name] is None):
            continue
        found = problem(types_[f.name], f.metadata, values[f.name])
        if found is not None:
            value, said = found
            if not flags:
                raise ConfigError(f"{f.name}={shown(value)} {said}")
            name = f.name if f.metadata.get("positional") else "--" + f.name.replace("_", "-")
            raise ConfigError(f"{name} {shown(value)} {said}")


def check_fields(obj: Any) -> None:
    """check_values for every field of the dataclass object `obj` (its __post_init__ calls it)."""
    check_values(type(obj), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})


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
