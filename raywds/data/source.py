"""The data section of a run's config: where its shards live, which the data part reads and
nothing else. The training config (raywds.config.TrainConfig) has these fields, as does any
object a caller builds with them; the data part asks for no more.

    manifest = manifest_of(cfg)          # cfg: any Source, the training config among them
"""

from __future__ import annotations

from typing import Protocol


class Source(Protocol):
    """Where a run's shards are: --data, --val-data, where foreign shards' indexes are kept, where
    the shards are when not beside their manifest, and the S3-compatible store s3:// names."""

    @property
    def data(self) -> str: ...
    @property
    def val_data(self) -> str | None: ...
    @property
    def index_cache(self) -> str | None: ...
    @property
    def shards_at(self) -> str | None: ...
    @property
    def s3_endpoint(self) -> str | None: ...


__all__ = ["Source"]
