"""Each `raywds` command's options as documented dataclasses, and which of them each command
takes (COMMAND_FLAGS). raywds.cli makes every flag from these (raywds.cli.flags) and, once the flags
are parsed, one typed object per group of them, which the command in raywds.cli.commands takes. The
training flags come from TrainConfig (given as Training), `raywds ray`'s from
raywds.launch.rayoptions.RayOptions, `raywds serve`'s from raywds.serve.ServerOptions,
`raywds convert`'s from raywds.data.shardoptions.ConvertOptions.

    raywds.cli.commands.cmd_ray(Source(data="shards/"), Training({"epochs": 1}), RayOptions(num_workers=2))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from raywds.data.shardoptions import ConvertOptions, IndexOptions
from raywds.data.source import Endpoint
from raywds.errors import ConfigError
from raywds.fields import ADDRESS, HOST, PATH, PLACE, SHARDS, TEXT, check_values, flag
from raywds.infer.predictoptions import Prediction, PredictPlane
from raywds.launch.rayoptions import RayOptions
from raywds.plan.modes import Schedule
from raywds.serve import BACKENDS, ServerOptions
from raywds.train.config import MAX_EPOCHS, TrainConfig, check_known, resolve
from raywds.train.recipes import RECIPES

DEMO_DIR = "runs/demo"


@dataclass(frozen=True, kw_only=True)
class MainOptions:
    debug: bool = False
    """Show the full traceback of an error, not just its one line."""


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    out: str = field(default=f"{DEMO_DIR}/images", metadata=flag(form=PATH))
    """Output folder."""


@dataclass(frozen=True, kw_only=True)
class ConvertWhere(Endpoint):
    src: str = field(metadata=flag(positional=True, form=PLACE))
    """Folder holding train/<class>/* and val/<class>/*, or one ImageFolder; or such a tree under an s3:// or
    gs:// prefix, or behind an http(s):// directory listing. (Shards already written, as a brace list or a
    glob, need no converting: give them to --data, or to `raywds index`.)"""
    out: str = field(metadata=flag(positional=True, form=PLACE))
    """Output folder for the shards, or an s3:// or gs:// prefix (s3://BUCKET/PREFIX)."""
    staging: str | None = field(default=None, metadata=flag(form=PATH))
    """With an s3:// OUT: the local folder to convert into first (default: in /tmp)."""
    append: bool = False
    """Add SRC's images to the dataset in OUT as new shards and a new manifest version (existing shards and labels
    unchanged, new classes after the old; OUT's shard settings)."""
    ray: bool = False
    """Write the shards with Ray tasks on every node of the cluster (--address, RAY_ADDRESS, a running `ray start`,
    else a local one): the same shards as without; SRC and OUT must be folders every node sees."""
    address: str | None = field(default=None, metadata=flag(form=ADDRESS))
    """With --ray: the Ray cluster's address (default: RAY_ADDRESS, a running `ray start`, else a new local cluster)."""


@dataclass(frozen=True, kw_only=True)
class VerifyOptions(Endpoint):
    shards: str = field(metadata=flag(positional=True, form=SHARDS))
    """Shard folder (with manifest.json), an s3:// or gs:// prefix, or shards as a run's --data names them (a
    brace list, a glob: checked against the index the run made of them)."""


@dataclass(frozen=True, kw_only=True)
class IndexWhere(Endpoint):
    shards: list[str] | None = field(default=None, metadata=flag(positional=True, nargs="*", form=SHARDS))
    """Shards as WebDataset names them: brace lists, globs, folders or bucket prefixes, pipe: templates
    (local, http(s)://, s3://, gs://); split into train and val by name (*train*, *val*, *validation*)."""
    train: list[str] | None = field(default=None, metadata=flag(append=True, form=SHARDS))
    """Training shards (instead of SHARDS; repeatable)."""
    val: list[str] | None = field(default=None, metadata=flag(append=True, form=SHARDS))
    """Validation shards (with --train; repeatable)."""
    out: str | None = field(default=None, metadata=flag(form=PLACE))
    """Folder or bucket prefix for manifest.json (default: beside the shards, where that is writable)."""


@dataclass(frozen=True, kw_only=True)
class AuditOptions(Endpoint):
    audit_dir: Path = field(metadata=flag(positional=True, form=PATH))
    """The run's --audit-dir."""
    data: str = field(metadata=flag(form=SHARDS))
    """The run's --data (its manifest numbers the samples)."""
    index_cache: str | None = field(default=None, metadata=flag(form=PATH))
    """The run's --index-cache, where --data named shards without a manifest."""
    epochs: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_EPOCHS))
    """Check the first N epochs (default: every epoch the files hold)."""


@dataclass(frozen=True, kw_only=True)
class ShardsumOptions:
    names: list[str] | None = field(default=None, metadata=flag(positional=True, nargs="*", form=TEXT))
    """Shard names; read from stdin when none are given."""


@dataclass(frozen=True, kw_only=True)
class ServeOptions(ServerOptions):
    """A ShardServer's options (raywds.serve.ServerOptions), on every interface at port 8080 unless
    told otherwise, and what `raywds serve` does besides serving."""

    shards: str | None = field(default=None, metadata=flag(positional=True, nargs="?", form=PATH))
    """Shard folder (with manifest.json)."""
    host: str = field(default="0.0.0.0", metadata=flag(form=HOST))
    """Address to listen on (0.0.0.0: every interface, for multi-node jobs)."""
    local: bool = False
    """Listen on 127.0.0.1 only (single-node jobs)."""
    port: int = field(default=8080, metadata=flag(minimum=0, maximum=65_535))
    """Port (0 picks a free one)."""
    stop_all: bool = False
    """Remove every raywds shard-server container and exit."""


SERVER_ONLY = ("ready_timeout_s", "idle_timeout_s", "num_threads")
"""ServerOptions fields that `raywds serve` leaves at their defaults (no flags)."""


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    data: str | None = field(default=None, metadata=flag(form=SHARDS))
    """Shards as --data names them: a folder, manifest.json, a URL, an s3:// or gs:// prefix, a brace list or a
    glob (or give --num-shards and --samples-per-shard)."""
    num_shards: int | None = field(default=None, metadata=flag(minimum=1, maximum=10**7))
    """Without --data: this many training shards."""
    samples_per_shard: int | None = field(default=None, metadata=flag(minimum=1, maximum=10**9))
    """Without --data: samples in each shard."""
    last_shard_samples: int | None = field(default=None, metadata=flag(minimum=1, maximum=10**9))
    """Without --data: samples in the last shard (default: as the others)."""
    nodes: int = field(default=1, metadata=flag(minimum=1, maximum=100_000))
    """Nodes in the job."""
    gpus_per_node: int = field(default=8, metadata=flag(minimum=1, maximum=1024))
    """Ranks per node."""
    epoch: int = field(default=0, metadata=flag(minimum=0, maximum=MAX_EPOCHS))
    """Which epoch's shuffle to show."""
    ranks_shown: int = field(default=16, metadata=flag(minimum=1, maximum=10**6))
    """Rows of the per-rank table."""
    shuffle_report: bool = False
    """Also measure how well the loader order mixes the data."""
    classes: int = field(default=1000, metadata=flag(minimum=1, maximum=10**7))
    """--shuffle-report without --data: classes in the data."""
    report_batches: int = field(default=50, metadata=flag(minimum=1, maximum=10**6))
    """--shuffle-report: batches per rank to simulate."""


@dataclass(frozen=True, kw_only=True)
class RunOptions(Endpoint):
    run_dir: str = field(metadata=flag(positional=True, form=PLACE))
    """A run's folder (the --out of a local run, a Ray run's folder) or s3://… prefix, with metrics.jsonl."""


@dataclass(frozen=True, kw_only=True)
class ReportOptions(RunOptions):
    out: str | None = field(default=None, metadata=flag(form=PATH))
    """PNG path (default RUN_DIR/report.png; NAME-report.png here for an s3:// run)."""


@dataclass(frozen=True, kw_only=True)
class DoctorOptions(RunOptions):
    epoch: int | None = field(default=None, metadata=flag(minimum=1, maximum=MAX_EPOCHS))
    """The epoch to look at, from 1 (default: the last)."""


SplitName = Literal["val", "train"]


@dataclass(frozen=True, kw_only=True)
class EvaluateOptions:
    model: str = field(metadata=flag(positional=True, form=PATH))
    """The trained model: a run folder (its checkpoint.pt), a checkpoint file, or an export folder."""
    data: str = field(metadata=flag(form=SHARDS))
    """Shards, as `raywds train --data` names them: a folder, manifest.json, an http(s) URL, an s3:// or gs://
    prefix, a brace list, a glob or a pipe: template (indexed once on first use)."""
    split: SplitName = "val"
    """The split to score: every one of its samples exactly once."""
    out: str | None = field(default=None, metadata=flag(form=PATH))
    """Folder for metrics.json, per_class.csv, confusion.csv and confused.png (default: evaluation-SPLIT in
    MODEL's folder, or beside a checkpoint file)."""
    ema: bool = False
    """Score the --model-ema average the checkpoint or export holds, alone (by default the weights are scored,
    and the average beside them where there is one)."""
    ray: bool = False
    """Score with Ray tasks on the cluster (--address, RAY_ADDRESS, a running `ray start`, else a local one),
    one a GPU; the shards must be where every node reads them."""
    address: str | None = field(default=None, metadata=flag(form=ADDRESS))
    """With --ray: the Ray cluster's address."""
    num_workers: int | None = field(default=None, metadata=flag(minimum=1, maximum=100_000))
    """With --ray: tasks (ranks) to score with (default: one a GPU of the cluster; 2 without GPUs)."""


EVALUATE_FIELDS = (
    "val_data",
    "index_cache",
    "shards_at",
    "s3_endpoint",
    "batch_size",
    "loader_workers",
    "decode",
    "precision",
    "cache_dir",
    "read_timeout",
    "read_retries",
    "verify_hashes",
    "loader_timeout",
    "pg_timeout",
)
"""The TrainConfig fields `raywds evaluate` takes: how the shards are found and read, as in training."""


@dataclass(frozen=True, kw_only=True)
class ExportOptions(Endpoint):
    model: str = field(metadata=flag(positional=True, form=PATH))
    """The trained model: a run folder (its checkpoint.pt), RUN/best, a checkpoint file, or an export folder."""
    out: str = field(metadata=flag(form=PATH))
    """The export's folder: model.safetensors, model.json (and model_ema.safetensors, config.json, model.onnx)."""
    ema: bool = False
    """Export the --model-ema average as model.safetensors, alone (by default the weights, with the average beside
    them as model_ema.safetensors where the run kept one)."""
    onnx: bool = False
    """Also write model.onnx (dynamic batch axis), kept only when onnxruntime's logits on validation images are
    within 1e-3 of the model's, with every top-1 the same (else model.onnx.rejected, exit 1)."""
    data: str | None = field(default=None, metadata=flag(form=SHARDS))
    """--onnx: shards with a val split to check on (default: the run's own --data)."""
    check_images: int = field(default=128, metadata=flag(minimum=1, maximum=10**7))
    """--onnx: check on the val split's first this many images."""
    force: bool = False
    """Replace an export already in --out (a folder holding anything else is never replaced)."""


@dataclass(frozen=True, kw_only=True)
class PredictOptions(Prediction):
    """What `raywds predict` predicts (raywds.infer.predictoptions.Prediction), and how it uses Ray."""

    ray: bool = False
    """Predict on the Ray cluster (--address, RAY_ADDRESS, a running `ray start`, else a local one); --data, MODEL
    and --out must be where every node reads and writes them."""
    address: str | None = field(default=None, metadata=flag(form=ADDRESS))
    """With --ray: the Ray cluster's address."""
    num_workers: int | None = field(default=None, metadata=flag(minimum=1, maximum=100_000))
    """With --ray: ranks (--data-plane loader) or model replicas (--data-plane ray) (default: one a GPU of the
    cluster; without GPUs, 2 ranks, or one replica per CPU less those left to read and decode)."""
    data_plane: PredictPlane = "loader"
    """With --ray: each rank reads and decodes with its own loader workers in a Ray task (loader, the
    faster in benchmarks/predict_bench.py), or Ray Data read tasks decode for a pool of model replicas (ray)."""


PREDICT_FIELDS = tuple(name for name in EVALUATE_FIELDS if name != "val_data")
"""The TrainConfig fields `raywds predict` takes: how the shards are found and read, as in training."""


@dataclass(frozen=True, kw_only=True)
class Source:
    data: str | None = field(default=None, metadata=flag(exclusive="source", form=SHARDS))
    """Shards: a folder, manifest.json, an http(s) URL a shard server serves, an s3:// or gs:// prefix, or
    WebDataset shards as you name them (brace list, glob, pipe: template), indexed once on first use."""
    demo: bool = field(default=False, metadata=flag(exclusive="source"))
    """Generate, convert and serve the demo data, then train on it."""
    recipe: str | None = field(default=None, metadata=flag(choices=tuple(RECIPES)))
    """Preset values (flags and --config override them)."""
    config: str | None = field(default=None, metadata=flag(form=PATH))
    """A .json or .toml file of config fields (overrides the recipe; flags override it)."""
    demo_dir: str = field(default=DEMO_DIR, metadata=flag(form=PATH))
    """Where --demo keeps its images and shards."""
    server_backend: str = field(default="auto", metadata=flag(choices=BACKENDS))
    """Shard server for --demo and --serve."""

    def config_for(self, data: str, training: Training) -> TrainConfig:
        """The run's config on `data` (--data, or the URL the demo shards are served at): the recipe
        (`demo` for --demo), then the --config file, then the training flags given."""
        recipe = self.recipe or ("demo" if self.demo else None)
        return resolve(data, recipe=recipe, config_file=self.config, **training.given)


@dataclass(frozen=True)
class Training:
    """The training flags given: TrainConfig fields by name, only those set on the command line;
    the recipe, the --config file and the config's defaults decide the rest (Source.config_for)."""

    given: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_known(dict(self.given), "the training flags")

    @classmethod
    def from_flags(cls, **values: Any) -> Training:
        """From the training flags' values, each None where not given."""
        return cls({name: value for name, value in values.items() if value is not None})


@dataclass(frozen=True)
class Flags:
    """One dataclass's fields as flags (raywds.cli.flags.add_flags's keywords), and the object the
    command takes of their parsed values."""

    cls: type
    skip: tuple[str, ...] = ()
    only: tuple[str, ...] | None = None
    with_defaults: bool = True
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    into: Callable[..., Any] | None = None
    """Makes the command's object from the flags' values, given as keywords (default: `cls`)."""

    def keywords(self) -> dict[str, Any]:
        return {"skip": self.skip, "only": self.only, "with_defaults": self.with_defaults, "aliases": self.aliases}

    def build(self, values: dict[str, Any]) -> Any:
        """What the command takes: `into` (or `cls`) of the values of these flags, each first
        checked against its field's declaration (raywds.fields.check_values), so that a value out of
        range is one line before any command starts."""
        check_values(self.cls, values, flags=True)
        return (self.into or self.cls)(**values)


def check_together(options: list[Any]) -> None:
    """What a command's groups of options decide together, checked before the command starts
    anything: the training config a Source and the training flags make (the recipe, the --config
    file and the flags: each value, and the checks across them), and its crops against --model."""
    source = next((o for o in options if isinstance(o, Source)), None)
    training = next((o for o in options if isinstance(o, Training)), None)
    if source is not None and training is not None and (source.data or source.demo):  # else the command says what
        check_crops(source.config_for(source.data or source.demo_dir, training))


def check_crops(cfg: TrainConfig) -> None:
    """Refuse a training or validation crop too small for --model, saying the smallest it takes
    (raywds.models.sizes: the model run once on the meta device; an unknown --model is refused too)."""
    from raywds.models.sizes import smallest_side

    train = "--train-crop-size" if cfg.train_crop_size else "--progressive-resize MIN" if cfg.progression else None
    for name, side, training in (
        (train or "--image-size", min(cfg.train_sizes), True),
        ("--val-crop-size" if cfg.val_crop_size else "--image-size", cfg.val_crop, False),
    ):
        batch = min(cfg.batch_size, 2) if training else 1
        least = smallest_side(cfg.model, side, batch=batch, training=training)
        if least is not None:
            where = f"training (a batch of {batch})" if training else "validation"
            raise ConfigError(
                f"{name} {side} is too small for --model {cfg.model}: it takes {least} px or more in {where}; "
                f"give {name} {least} or more"
            )


# None unless given: the recipe and the --config file keep theirs.
TRAINING = Flags(TrainConfig, with_defaults=False, into=Training.from_flags)
COMMAND_FLAGS: dict[str, tuple[str, tuple[Flags, ...]]] = {
    "demo": ("write the generated demo ImageNet-layout tree", (Flags(DemoOptions),)),
    "convert": (
        "ImageNet tree or ImageFolder (a folder, s3://, gs:// or an http listing) -> WebDataset shards + "
        "manifest.json, into a folder, s3:// or gs://",
        (Flags(ConvertWhere), Flags(ConvertOptions)),
    ),
    "verify": ("re-read every shard and check it against manifest.json", (Flags(VerifyOptions),)),
    "index": (
        "write a manifest for existing WebDataset shards (anyone's), without rewriting them",
        (Flags(IndexWhere), Flags(IndexOptions)),
    ),
    "audit": ("check a run's --audit-dir: every sample trained on once per epoch", (Flags(AuditOptions),)),
    "shardsum": ("shard names (arguments or stdin) in brace notation", (Flags(ShardsumOptions),)),
    "serve": (
        "serve a shard folder over HTTP until interrupted (nginx in Docker, local nginx, or embedded)",
        (Flags(ServeOptions, skip=SERVER_ONLY),),
    ),
    "plan": (
        "show what each rank and loader worker reads in an epoch, and whether the setup would hang",
        (
            Flags(PlanOptions),
            Flags(Schedule, aliases={"loader_workers": ("--workers",)}),
        ),
    ),
    "report": ("plot a run's loss, accuracy, throughput and data wait to a PNG", (Flags(ReportOptions),)),
    "doctor": (
        "why a run's GPUs waited: the bottleneck, the rank and node, and what to change",
        (Flags(DoctorOptions),),
    ),
    "train": ("train in this process (or one torchrun rank), no Ray", (Flags(Source), TRAINING)),
    "ray": (
        "train with a Ray Train TorchTrainer on the cluster (one worker per GPU)",
        # A Ray run's folder is under --storage-path.
        (Flags(Source), dataclasses.replace(TRAINING, skip=("out",)), Flags(RayOptions)),
    ),
    "evaluate": (
        "score a trained model on a split (top-1, top-5, loss, per class, confusion): every sample once, in "
        "this process, under torchrun or with --ray",
        (Flags(EvaluateOptions), dataclasses.replace(TRAINING, only=EVALUATE_FIELDS)),
    ),
    "export": (
        "write a trained model as model.safetensors + model.json (timm's layout for timm models), and with --onnx "
        "an ONNX file checked against onnxruntime",
        (Flags(ExportOptions),),
    ),
    "predict": (
        "write a trained model's top-k classes for every sample, keyed, one part per shard: each key once, in this "
        "process, under torchrun or with --ray; run again, it resumes",
        (Flags(PredictOptions), dataclasses.replace(TRAINING, only=PREDICT_FIELDS)),
    ),
}
