"""What lets an interrupted `raywds convert` resume: the settings of the run writing a folder,
and a journal of the shards it finished.

    done = prepare_output(out, fingerprint, prefix="imagenet", overwrite=False)
    with Journal(out) as journal:
        journal.add(record)            # after each shard is renamed into place

A rerun with the same fingerprint keeps every journalled shard whose size and sha256 still
match (`still_good`); another fingerprint in a used folder is refused, or with `overwrite`
its shards are removed first.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

from raywds.data.columns import COLUMNS
from raywds.data.manifest import MANIFEST, TIMM_INFO, write_json_atomic
from raywds.data.sources import DIGESTS, SOURCES
from raywds.data.verify import sha256_file
from raywds.errors import DataError

STATE = ".raywds-convert.json"  # the settings of the run writing this folder
JOURNAL = ".raywds-done.jsonl"  # one line per finished shard


def still_good(path: Path, done: dict[str, Any]) -> bool:
    """Whether the shard at `path` is the one the journal record `done` describes."""
    info = done["shard"]
    return path.is_file() and path.stat().st_size == info["num_bytes"] and sha256_file(path) == info["sha256"]


def _ours(out: Path, prefix: str) -> list[Path]:
    names = [MANIFEST, COLUMNS, TIMM_INFO, STATE, JOURNAL, SOURCES]
    return [
        p
        for p in out.iterdir()
        if p.name in names
        or (p.name.endswith(".tar") and p.name.lstrip(".").startswith(f"{prefix}-"))
        or (p.name.endswith(".tmp") and p.name.startswith(f".{prefix}-"))
    ]


def prepare_output(out: Path, wanted: str, *, prefix: str, overwrite: bool) -> dict[str, dict[str, Any]]:
    """Check that `out` is empty or holds this same conversion (fingerprint `wanted`); returns
    its finished shards' journal records by name."""
    out.mkdir(parents=True, exist_ok=True)
    state = out / STATE
    same = state.is_file() and json.loads(state.read_text()).get("fingerprint") == wanted
    if not same and any(out.iterdir()):
        if not overwrite:
            raise DataError(
                f"{out} is not empty and was not written by this conversion (other source, layout, seed or "
                f"shard limits); pass --overwrite to replace its shards, or choose an empty folder"
            )
        for path in _ours(out, prefix):
            path.unlink()
    if not same:
        write_json_atomic(state, {"fingerprint": wanted})
        (out / JOURNAL).write_text("")
        return {}
    return _journalled(out)


def prepare_append(out: Path, wanted: str) -> dict[str, dict[str, Any]]:
    """For an append (fingerprint `wanted`) to the dataset in `out`: the journal records of the new
    shards an interrupted run of this same append finished; else a fresh journal, and nothing of
    the dataset's own is touched."""
    state = out / STATE
    if state.is_file() and json.loads(state.read_text()).get("fingerprint") == wanted:
        return _journalled(out)
    write_json_atomic(state, {"fingerprint": wanted})
    (out / JOURNAL).write_text("")
    return {}


def _journalled(out: Path) -> dict[str, dict[str, Any]]:
    done = {}
    for line in (out / JOURNAL).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            done[record["shard"]["name"]] = record
    return done


class Journal:
    """Appends a line for each finished shard to `out`'s journal, flushed at once."""

    def __init__(self, out: Path) -> None:
        self._file = (out / JOURNAL).open("a")

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._file.close()

    def add(self, record: dict[str, Any]) -> None:
        """`record`: the shard's ShardInfo fields under "shard", the images it skipped, and the
        sha256 of each image it holds (raywds.data.sources)."""
        self._file.write(
            json.dumps({k: record[k] for k in ("shard", "skipped", "first_key", "node", DIGESTS) if k in record}) + "\n"
        )
        self._file.flush()
