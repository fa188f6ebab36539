"""One frozen config shared by the CLI, the notebook and the Ray job, composed of the sections its
parts declare and check (SECTIONS): where the shards are (raywds.data.source.Source), the epoch's
plan (raywds.plan.modes.Schedule), how the loader reads and crops (raywds.loader.settings.Loading),
the run's record (raywds.runs.recording.Recording) and the model (raywds.models.spec.ModelSpec),
with the training's own settings beside them and the checks across sections.

from raywds.train.config import TrainConfig
cfg = TrainConfig(data="shards/", epochs=3, model="resnet18")
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Literal

from raywds.data.source import Source
from raywds.errors import ConfigError
from raywds.fields import MAX_EPOCHS, MAX_SECONDS, MAX_STEPS, check_values, flag
from raywds.loader.settings import MAX_SIDE, LoaderConfig, Loading
from raywds.models.spec import ModelSpec
from raywds.plan.modes import Schedule
from raywds.runs.recording import Recording
from raywds.train.recipes import RECIPES

# The choices of each setting; the CLI's --help and choices come from these (raywds.cli.flags).
Optimizer = Literal["sgd", "adamw"]
Precision = Literal["auto", "bf16", "fp32"]
MemoryFormat = Literal["auto", "channels_last", "contiguous"]

PROGRESSIVE_STEP_PX = 32
"""--progressive-resize's sizes go up in steps of this many pixels (FFCV's schedule)."""


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
class TrainConfig(Source, Schedule, Loading, Recording, ModelSpec):
    """Everything a training run needs to know: its parts' sections (Source, Schedule, Loading,
    Recording, ModelSpec) and the training's own settings below (the optimizer, its schedule and
    recipe, precision); the world (rank, size) is passed separately."""

    epochs: int = field(default=3, metadata=flag(minimum=1, maximum=MAX_EPOCHS))
    """Passes over the training split."""
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
    pg_timeout: int = field(default=300, metadata=flag(minimum=1, maximum=MAX_SECONDS))
    """Process-group timeout: a stalled collective becomes an error after this long."""
    max_bad_samples: float = field(default=0.001, metadata=flag(minimum=0, maximum=MAX_STEPS))
    """resample mode: samples that cannot be decoded are skipped and counted, up to this many distinct
    ones per epoch (below 1: a fraction of the epoch's samples; each draw of a sample is skipped,
    the sample counts once), then the run stops. Split mode never skips."""
    global_batch: int | None = field(default=None, metadata=flag(minimum=1, maximum=2**24))
    """Samples each optimizer step sees, on any number of ranks: each rank adds up the gradients
    of global_batch / (ranks x --batch-size) batches a step, so an elastic resize keeps the
    optimisation the same (None: one batch a rank, a step)."""

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

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The config by section, as config.json, a checkpoint and the trackers hold it:
        {"data": {"data": ..., ...}, "plan": {...}, "loader": {...}, "run": {...}, "model": {...}, "train": {...}}."""
        flat = dataclasses.asdict(self)
        return {key: {name: flat[name] for name in names} for key, names in section_fields().items()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """The config of a dict by section (to_dict's, config.json's, a config file's)."""
        return cls(**flatten(values, "config"))


SECTIONS = (Source, Schedule, Loading, Recording, ModelSpec)
"""The parts' sections the training config is composed of, each declared and checked by its part."""
SECTION_KEYS = {Source: "data", Schedule: "plan", Loading: "loader", Recording: "run", ModelSpec: "model"}
"""Each section's key in config.json and config files; "train" holds the training's own settings."""


@functools.cache
def section_fields() -> dict[str, tuple[str, ...]]:
    """Each section's key and its fields' names, the training's own last ("train")."""
    keyed = {SECTION_KEYS[section]: tuple(f.name for f in dataclasses.fields(section)) for section in SECTIONS}
    return {**keyed, "train": own_fields()}


def flatten(values: dict[str, Any], where: str) -> dict[str, Any]:
    """{section: {field: value}} as {field: value}, refusing in one line, naming `where` they came
    from, a section or a key that is not one, or a key in another section than its own."""
    sections = section_fields()
    home = {name: key for key, names in sections.items() for name in names}
    flat: dict[str, Any] = {}
    for key, fields in values.items():
        if key in home and key not in sections:
            raise ConfigError(
                f"{where}: {key} belongs in section [{home[key]}] (the config is by section: {', '.join(sections)})"
            )
        if key not in sections:
            raise ConfigError(f"{where} has an unknown section {key!r}; the sections are {', '.join(sections)}")
        if not isinstance(fields, dict):
            raise ConfigError(f"{where}: section [{key}] must hold its settings by name, not {fields!r}")
        for name, value in fields.items():
            if home.get(name) != key:
                said = f"belongs in section [{home[name]}]" if name in home else "is not a setting"
                raise ConfigError(
                    f"{where}: {name} in section [{key}] {said}; [{key}] holds {', '.join(sections[key])}"
                )
            flat[name] = value
    return flat


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
    """TrainConfig fields from a .json or .toml file of sections (a TOML table or a JSON object
    each: [plan] batch_size = 256), as {field: value}."""
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
    return flatten(values, f"config file {path}")


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
