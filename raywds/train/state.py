"""What survives a resume: the checkpoint's contents (model, optimizer, the epoch keeper's
progress and data position under `progress`, the shards and classes it was trained on), and
restoring them. The learning rate is a function of progress, so it needs no state of its own.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from raywds.errors import ConfigError
from raywds.models.start import Start, grow_checkpoint
from raywds.plan.position import check_same_shards, grown, shard_entries
from raywds.train.config import TrainConfig
from raywds.train.epoch import EpochKeeper

log = logging.getLogger(__name__)


def checkpoint_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    keeper: EpochKeeper,
    cfg: TrainConfig,
    ema: nn.Module | None = None,
) -> dict[str, Any]:
    """The weights (and --model-ema's average), the optimizer, the epoch keeper's counters and
    position (`progress`: its `state_dict`), and what they were trained on (the shards, the
    classes, the config)."""
    return {
        "model": model.state_dict(),
        **({"model_ema": ema.state_dict()} if ema is not None else {}),
        "optimizer": optimizer.state_dict(),
        "progress": keeper.state_dict(),
        "shards": shard_entries(keeper.manifest),
        "config": cfg.to_dict(),
        "classes": keeper.manifest.classes,
    }


def saved_progress(state: dict[str, Any]) -> dict[str, Any]:
    """The epoch keeper's part of a checkpoint (`EpochKeeper.load_state_dict` takes it)."""
    return dict(state["progress"])


def check_unfinished(state: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse to resume a run that has already trained all of `cfg.epochs`: there is nothing
    left to do, and nothing to report."""
    progress = saved_progress(state)
    done = progress["epoch"]
    if done >= cfg.epochs and not progress.get("position"):
        raise ConfigError(
            f"the checkpoint at {cfg.resume} has already trained {done} epochs, and --epochs is "
            f"{cfg.epochs}: nothing is left to train; to train more, resume with a larger --epochs "
            f"(e.g. --epochs {done + 1})"
        )


def restore(
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    keeper: EpochKeeper,
    ema: nn.Module | None = None,
    started: Start | None = None,
) -> None:
    """Load a checkpoint's weights, optimizer and progress, after checking it was taken on these
    classes and shards (and, inside an epoch, in this mode). Classes an append added since (the
    checkpoint's are the data's first) grow the classifier of `started`'s model (raywds.models.start).
    Shards an append added after the checkpoint's are trained on from the next epoch that starts
    (EpochKeeper.grew)."""
    manifest = keeper.manifest
    saved_model = ((state.get("config") or {}).get("model") or {}).get("model")  # its model section's --model
    if started is not None and saved_model and saved_model != str(started.name):
        raise ConfigError(
            f"the checkpoint was trained as --model {saved_model}, not {started.name}: "
            f"resume with --model {saved_model}"
        )
    before = grown(state["shards"], manifest)
    if state["classes"] != manifest.classes:
        saved = state["classes"]
        if started is None or manifest.classes[: len(saved)] != saved:
            raise ConfigError(
                f"the checkpoint's {len(state['classes'])} classes differ from the data's "
                f"{len(manifest.classes)}; resume with the same --data"
            )
        fit = grow_checkpoint(state, started, optimizer, manifest.classes)
        if keeper.world.is_main:
            new = manifest.classes[len(saved) :]
            classes = "class" if len(new) == 1 else "classes"
            log.info(f"the data gained {len(new)} {classes} since the checkpoint ({', '.join(new[:5])}): {fit.line()}")
    if before is None:
        check_same_shards(state["shards"], manifest)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if ema is not None:  # a checkpoint from before --model-ema starts the average from these weights
        if "model_ema" in state:
            ema.load_state_dict(state["model_ema"])
        else:
            log.info("the checkpoint holds no --model-ema average: it starts from the resumed weights")
    if before is None:
        keeper.load_state_dict(saved_progress(state))
        return
    said = keeper.grew(saved_progress(state), before)
    if keeper.world.is_main:
        log.info(said)
