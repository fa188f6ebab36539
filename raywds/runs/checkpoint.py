"""Checkpoint files: where a checkpoint is (a file, a run folder, a Ray checkpoint folder),
loading one without running code from it, and writing one that survives a crash.

A checkpoint holds tensors, numbers, strings, bytes, lists and dicts only, so it is loaded with
`torch.load(weights_only=True)`: a run folder on shared storage is written by others, and a
pickle that names any other type (a planted `os.system`) is refused, not run.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from raywds.data.stores import sync_path
from raywds.errors import ConfigError, StorageError
from raywds.runs import files


def checkpoint_file(path: str) -> Path:
    """A checkpoint file, or checkpoint.pt in a directory (a run folder or a Ray checkpoint)."""
    where = Path(path)
    if where.is_dir():
        where = where / files.CHECKPOINT
    if not where.is_file():
        raise ConfigError(f"no checkpoint at {where}: give a checkpoint.pt or the folder holding it (--resume)")
    return where


def load_checkpoint(path: str, *, named: str | None = None, instead: str | None = None) -> dict[str, Any]:
    """The state saved at `path` (a file or its folder); StorageError, in one line, for a file
    that holds any type a checkpoint of ours does not, and for a damaged one. The messages call the
    file `named` (a downloaded copy by where it came from), and a damaged one's says `instead` in
    place of the earlier checkpoint found beside it."""
    where = checkpoint_file(path)
    name = named or str(where)

    def damaged(e: BaseException) -> StorageError:
        return StorageError(f"checkpoint {name} is damaged ({_first_line(e)}); {instead or _instead(where)}")

    try:
        state = torch.load(where, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise damaged(e) from None
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found.group(1) if found else _first_line(e)
        raise StorageError(
            f"checkpoint {name} holds a {what}, which raywds's checkpoints never hold: not loaded, as it could run "
            "code; it was not written by raywds (or was changed since), resume from a checkpoint you trust"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:  # a file cut short or overwritten
        raise damaged(e) from None
    if not isinstance(state, dict) or "model" not in state:
        raise StorageError(f"checkpoint {name} is not a raywds checkpoint (no model state in it)")
    return state


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:160] if text else type(e).__name__


def earlier_checkpoints(where: Path) -> list[Path]:
    """Other checkpoints of the run `where` belongs to: a run folder's best/; for a Ray checkpoint
    folder (checkpoint_*), the others beside it, newest first, then the run folder's best/."""
    found = [where.parent / files.BEST / files.CHECKPOINT]
    if where.parent.name.startswith("checkpoint_"):
        siblings = where.parent.parent.glob(f"checkpoint_*/{files.CHECKPOINT}")
        found = [
            *sorted(siblings, key=lambda p: p.stat().st_mtime, reverse=True),
            where.parent.parent / files.BEST / files.CHECKPOINT,
        ]
    return [p for p in found if p.is_file() and p.resolve() != where.resolve()]


def _instead(where: Path) -> str:
    others = earlier_checkpoints(where)
    if not others:
        return "no other checkpoint of this run was found beside it: start the run again without --resume"
    return f"an earlier checkpoint of this run is {others[0]}: --resume {others[0].parent}"


class _Count:
    """A file that only counts what is written to it: the size a checkpoint needs."""

    size = 0

    def write(self, data: bytes) -> int:
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def save_checkpoint(state: dict[str, Any], path: Path, *, durable: bool = True) -> None:
    """Write `state` to `path` atomically: a reader never sees half a file. `durable`: the file
    and its folder are flushed to the disk (fsync) before and after the rename, so that after a
    power cut the name holds either the old checkpoint or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        tmp.replace(path)
        if durable:
            sync_path(path.parent)
    except (RuntimeError, OSError) as e:
        tmp.unlink(missing_ok=True)
        raise _not_written(state, path, e) from None


def _not_written(state: dict[str, Any], path: Path, e: BaseException) -> StorageError:
    """The one-line error for a checkpoint that could not be written, saying what was kept."""
    kept = f"the previous {path.name} there is kept" if path.is_file() else f"no earlier {path.name} was there"
    needed = _Count()
    torch.save(state, needed)  # type: ignore[arg-type]
    free = shutil.disk_usage(path.parent).free
    if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or needed.size > free:
        return StorageError(
            f"cannot write checkpoint {path}: no space left on its disk (it needs {needed.size} bytes, "
            f"{free} are free); {kept}; free some space or give another --out"
        )
    return StorageError(f"cannot write checkpoint {path} ({_first_line(e)}); {kept}")
