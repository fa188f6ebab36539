"""raywds: train image classifiers from WebDataset tar shards, on one machine or a Ray cluster.

    import raywds
    cfg = raywds.resolve("runs/demo/shards", recipe="demo", epochs=2)
    metrics = raywds.fit(cfg)                                   # this process, or a torchrun rank
    run = raywds.fit_on_ray(cfg, raywds.RayOptions(num_workers=2))

(`fit`, not `train`: `raywds.train` is the package of one rank's training.) The names below are
the public ones; each is imported when first used, so `import raywds`
loads neither torch nor Ray nor Lightning (`raywds convert` imports no torch at all).
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

__version__ = metadata.version("raywds")  # pyproject.toml's, as installed

_PUBLIC = {
    "TrainConfig": "raywds.train.config",
    "resolve": "raywds.train.config",
    "RaywdsError": "raywds.errors",
    "World": "raywds.world",
    "fit": "raywds.launch.local:train_in_process",
    "build_model": "raywds.train.model",
    "make_optimizer": "raywds.train.optim",
    "summary_line": "raywds.train.progress",
    "RayOptions": "raywds.launch.rayoptions",
    "connect": "raywds.launch.cluster",
    "fit_on_ray": "raywds.launch.ray_train:run",
    "follow": "raywds.runs.follow",
    "run_on_ray": "raywds.launch.ownloop",
    "ShardDataModule": "raywds.lightning.datamodule",
    "KeepTrackingIds": "raywds.lightning.loggers",
    "tracking_loggers": "raywds.lightning.loggers:loggers",
    "prepare_demo": "raywds.data.demo:prepare",
    "add_flags": "raywds.cli.flags",
    "given": "raywds.cli.flags",
}
__all__ = [
    "KeepTrackingIds",
    "RayOptions",
    "RaywdsError",
    "ShardDataModule",
    "TrainConfig",
    "World",
    "add_flags",
    "connect",
    "fit",
    "fit_on_ray",
    "follow",
    "build_model",
    "given",
    "make_optimizer",
    "prepare_demo",
    "resolve",
    "run_on_ray",
    "summary_line",
    "tracking_loggers",
]

if TYPE_CHECKING:
    from raywds.cli.flags import add_flags, given
    from raywds.data.demo import prepare as prepare_demo
    from raywds.errors import RaywdsError
    from raywds.launch.cluster import connect
    from raywds.launch.local import train_in_process as fit
    from raywds.launch.ownloop import run_on_ray
    from raywds.launch.ray_train import run as fit_on_ray
    from raywds.launch.rayoptions import RayOptions
    from raywds.lightning.datamodule import ShardDataModule
    from raywds.lightning.loggers import KeepTrackingIds
    from raywds.lightning.loggers import loggers as tracking_loggers
    from raywds.runs.follow import follow
    from raywds.train.config import TrainConfig, resolve
    from raywds.train.model import build_model
    from raywds.train.optim import make_optimizer
    from raywds.train.progress import summary_line
    from raywds.world import World


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'raywds' has no attribute {name!r}")
    module, _, attr = _PUBLIC[name].partition(":")
    return getattr(importlib.import_module(module), attr or name)
