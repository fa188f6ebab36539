"""What `raywds predict` predicts, with which model, into which folder: the options the per-rank
predict (raywds.infer.prediction) and its Ray launchers read; the command line adds how to use Ray
(raywds.cli.options.PredictOptions). Imports no torch, so `raywds --help` does not load it.

    Prediction(model="runs/local", data="shards/", out="preds", top_k=5)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from raywds.fields import PATH, SHARDS, flag


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What `raywds predict` predicts, with which model, and where it writes."""

    model: str = field(metadata=flag(positional=True, form=PATH))
    """A run folder (its checkpoint.pt), a checkpoint file, or an export folder (model.json + model.safetensors)."""
    data: str = field(metadata=flag(form=SHARDS))
    """Shards as a run's --data names them (a folder, manifest.json, a URL, an s3:// or gs:// prefix, a brace list, a
    glob), or a folder of image files (each row's key: the file's path relative to it)."""
    out: str = field(metadata=flag(form=PATH))
    """Folder for the predictions: one part per shard (or per 256 files) and _predictions.json; run again into it,
    a predict skips the parts already written."""
    top_k: int = field(default=5, metadata=flag(minimum=1, maximum=100_000))
    """Classes kept per sample, most probable first."""
    format: Literal["parquet", "jsonl"] = "parquet"
    """How each part is written."""
    split: Literal["all", "train", "val"] = "all"
    """Which of --data's splits to predict (all: every shard)."""

    @classmethod
    def of(cls, options: Any) -> Prediction:
        """The fields of this class that `options` (a subclass's object) holds."""
        return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(cls)})

    def absolute(self) -> Prediction:
        """With local paths absolute (a brace list or glob of local shards too), for processes that
        run in another folder (Ray's workers); URLs and `pipe:` commands stay."""
        paths = {
            name: os.path.abspath(value)
            for name in ("model", "data", "out")
            if "://" not in (value := getattr(self, name)) and not value.startswith("pipe:") and "," not in value
        }
        return dataclasses.replace(self, **paths)


PredictPlane = Literal["loader", "ray"]
"""`raywds predict --ray --data-plane`: ranks with their own loaders, or Ray Data (raywds.launch.ray_prediction)."""
