"""The data section of a run's config: where its shards live. The data part declares it, checks
it and reads nothing else; the training config (raywds.train.config.TrainConfig) is composed of it and
the other parts' sections, so a TrainConfig is a Source, and so is one built alone.

    source = Source(data="s3://bucket/imagenet/", s3_endpoint="http://127.0.0.1:8333")
    manifest = manifest_of(source)       # any Source, the training config among them
    source.storage.read("s3://bucket/imagenet/manifest.json")   # every store, S3's at that endpoint
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raywds.data.stores import Storage
from raywds.errors import ConfigError
from raywds.fields import PATH, PLACE, SHARDS, URL, check_fields, flag


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """Which store s3:// paths name: every command that reads or writes them takes it (a run's
    Source, and `convert`, `index`, `verify`, `audit`, `report`, `export`'s options)."""

    s3_endpoint: str | None = field(default=None, metadata=flag(form=URL))
    """The S3-compatible store's URL for s3:// paths (MinIO, AIStore, SeaweedFS, R2...); default
    AWS_ENDPOINT_URL, else AWS. Credentials come from boto3's chain (AWS_* variables, ~/.aws, a role)."""

    @property
    def storage(self) -> Storage:
        """Every store as this command reaches them: what the data functions take."""
        return Storage(self.s3_endpoint)


@dataclass(frozen=True, kw_only=True)
class Source(Endpoint):
    """Where a run's shards are: --data, --val-data, where foreign shards' indexes are kept, where
    the shards are when not beside their manifest, and the S3-compatible store s3:// names."""

    data: str = field(metadata=flag(form=SHARDS, set_otherwise=True))
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

    def __post_init__(self) -> None:
        if not self.data:
            raise ConfigError("data is empty: give a shard directory, manifest.json or http URL (--data)")
        check_fields(self, Source)  # each field's type, range and form, as declared above


__all__ = ["Endpoint", "Source"]
