"""Each `raywds` command's options as documented dataclasses, and which of them each command
takes (COMMAND_FLAGS). raywds.cli makes every flag from these (raywds.flags); raywds.commands
reads the parsed values. The training flags come from TrainConfig, `raywds ray`'s from
raywds.launch.rayoptions.RayOptions, `raywds convert`'s from raywds.data.convert.ConvertOptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raywds.config import RECIPES, S3Endpoint, TrainConfig
from raywds.data.shardoptions import ConvertOptions, IndexOptions
from raywds.fields import flag
from raywds.launch.rayoptions import RayOptions
from raywds.serve import BACKENDS, NETWORKS

DEMO_DIR = "runs/demo"


@dataclass(frozen=True, kw_only=True)
class MainOptions:
    debug: bool = False
    """Show the full traceback of an error, not just its one line."""


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    out: str = f"{DEMO_DIR}/images"
    """Output folder."""


@dataclass(frozen=True, kw_only=True)
class ConvertWhere(S3Endpoint):
    src: str = field(metadata=flag(positional=True))
    """Folder holding train/<class>/* and val/<class>/*, or one ImageFolder."""
    out: str = field(metadata=flag(positional=True))
    """Output folder for the shards, or s3://BUCKET/PREFIX."""
    staging: str | None = None
    """With an s3:// OUT: the local folder to convert into first (default: in /tmp)."""


@dataclass(frozen=True, kw_only=True)
class VerifyOptions(S3Endpoint):
    shards: str = field(metadata=flag(positional=True))
    """Shard folder (with manifest.json), or s3://BUCKET/PREFIX."""


@dataclass(frozen=True, kw_only=True)
class IndexWhere(S3Endpoint):
    shards: list[str] | None = field(default=None, metadata=flag(positional=True, nargs="*"))
    """Shards as WebDataset names them: brace lists, globs, folders or bucket prefixes, pipe: templates
    (local, http(s)://, s3://, gs://); split into train and val by name (*train*, *val*, *validation*)."""
    train: list[str] | None = field(default=None, metadata=flag(append=True))
    """Training shards (instead of SHARDS; repeatable)."""
    val: list[str] | None = field(default=None, metadata=flag(append=True))
    """Validation shards (with --train; repeatable)."""
    out: str | None = None
    """Folder or bucket prefix for manifest.json (default: beside the shards, where that is writable)."""


@dataclass(frozen=True, kw_only=True)
class AuditOptions(S3Endpoint):
    audit_dir: Path = field(metadata=flag(positional=True))
    """The run's --audit-dir."""
    data: str
    """The run's --data (its manifest numbers the samples)."""
    index_cache: str | None = None
    """The run's --index-cache, where --data named shards without a manifest."""
    epochs: int | None = None
    """Check the first N epochs (default: every epoch the files hold)."""


@dataclass(frozen=True, kw_only=True)
class ShardsumOptions:
    names: list[str] | None = field(default=None, metadata=flag(positional=True, nargs="*"))
    """Shard names; read from stdin when none are given."""


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    shards: str | None = field(default=None, metadata=flag(positional=True, nargs="?"))
    """Shard folder (with manifest.json)."""
    backend: str = field(default="auto", metadata=flag(choices=BACKENDS))
    """nginx in Docker, the local nginx, or the embedded Python server; auto tries them in that order."""
    host: str = "0.0.0.0"
    """Address to listen on (0.0.0.0: every interface, for multi-node jobs)."""
    local: bool = False
    """Listen on 127.0.0.1 only (single-node jobs)."""
    port: int = 8080
    """Port (0 picks a free one)."""
    advertise: str | None = None
    """Host name or IP workers should use (default: this node's IP, or 127.0.0.1 with --local)."""
    image: str = "nginx:stable"
    """Docker image with nginx."""
    network: str = field(default="host", metadata=flag(choices=tuple(NETWORKS)))
    """Docker: host networking, or publish the port from a bridge network."""
    no_pull: bool = False
    """Docker: use only a local image, never pull one."""
    stop_all: bool = False
    """Remove every raywds shard-server container and exit."""


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    data: str | None = None
    """Shard folder, manifest.json or URL (or give --num-shards and --samples-per-shard)."""
    num_shards: int | None = None
    """Without --data: this many training shards."""
    samples_per_shard: int | None = None
    """Without --data: samples in each shard."""
    last_shard_samples: int | None = None
    """Without --data: samples in the last shard (default: as the others)."""
    nodes: int = 1
    """Nodes in the job."""
    gpus_per_node: int = 8
    """Ranks per node."""
    epoch: int = 0
    """Which epoch's shuffle to show."""
    ranks_shown: int = 16
    """Rows of the per-rank table."""
    shuffle_report: bool = False
    """Also measure how well the loader order mixes the data."""
    classes: int = 1000
    """--shuffle-report without --data: classes in the data."""
    report_batches: int = 50
    """--shuffle-report: batches per rank to simulate."""


PLAN_FIELDS = (
    "mode",
    "canonical_nodes",
    "loader_workers",
    "batch_size",
    "batches_per_epoch",
    "seed",
    "worker_shuffle_buffer",
    "cross_worker_shuffle_buffer",
)
"""The config fields `raywds plan` takes, with the config's defaults."""


@dataclass(frozen=True, kw_only=True)
class RunOptions(S3Endpoint):
    run_dir: str = field(metadata=flag(positional=True))
    """A run's folder (the --out of a local run, a Ray run's folder) or s3://… prefix, with metrics.jsonl."""


@dataclass(frozen=True, kw_only=True)
class ReportOptions(RunOptions):
    out: str | None = None
    """PNG path (default RUN_DIR/report.png; NAME-report.png here for an s3:// run)."""


@dataclass(frozen=True, kw_only=True)
class DoctorOptions(RunOptions):
    epoch: int | None = None
    """The epoch to look at, from 1 (default: the last)."""


@dataclass(frozen=True, kw_only=True)
class Source:
    data: str | None = field(default=None, metadata=flag(exclusive="source"))
    """Shard directory, manifest.json, http(s) URL of a shard server, or s3://BUCKET/PREFIX."""
    demo: bool = field(default=False, metadata=flag(exclusive="source"))
    """Generate, convert and serve the demo data, then train on it."""
    recipe: str | None = field(default=None, metadata=flag(choices=tuple(RECIPES)))
    """Preset values (flags and --config override them)."""
    config: str | None = None
    """A .json or .toml file of config fields (overrides the recipe; flags override it)."""
    demo_dir: str = DEMO_DIR
    """Where --demo keeps its images and shards."""
    server_backend: str = field(default="auto", metadata=flag(choices=BACKENDS))
    """Shard server for --demo and --serve."""


@dataclass(frozen=True)
class Flags:
    """One dataclass's fields as flags (raywds.flags.add_flags's keywords)."""

    cls: type
    skip: tuple[str, ...] = ()
    only: tuple[str, ...] | None = None
    with_defaults: bool = True
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def keywords(self) -> dict[str, Any]:
        return {"skip": self.skip, "only": self.only, "with_defaults": self.with_defaults, "aliases": self.aliases}


TRAINING = Flags(TrainConfig, with_defaults=False)  # None unless given: the recipe and file keep theirs
COMMAND_FLAGS: dict[str, tuple[str, tuple[Flags, ...]]] = {
    "demo": ("write the generated demo ImageNet-layout tree", (Flags(DemoOptions),)),
    "convert": (
        "ImageNet tree or ImageFolder -> WebDataset shards + manifest.json",
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
        (Flags(ServeOptions),),
    ),
    "plan": (
        "show what each rank and loader worker reads in an epoch, and whether the setup would hang",
        (
            Flags(PlanOptions),
            Flags(TrainConfig, only=PLAN_FIELDS, aliases={"loader_workers": ("--workers",)}),
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
        (Flags(Source), Flags(TrainConfig, skip=("out",), with_defaults=False), Flags(RayOptions)),
    ),
}
