"""Checkpoint files: where a checkpoint is (a file, a run folder, a Ray checkpoint folder),
loading one, and writing one atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from raywds.errors import ConfigError

CHECKPOINT_FILE = "checkpoint.pt"


def checkpoint_file(path: str) -> Path:
    """A checkpoint file, or checkpoint.pt in a directory (a run folder or a Ray checkpoint)."""
    where = Path(path)
    if where.is_dir():
        where = where / CHECKPOINT_FILE
    if not where.is_file():
        raise ConfigError(f"no checkpoint at {where}: give a checkpoint.pt or the folder holding it (--resume)")
    return where


def load_checkpoint(path: str) -> dict[str, Any]:
    return torch.load(checkpoint_file(path), map_location="cpu", weights_only=False)


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Write `state` to `path` atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
