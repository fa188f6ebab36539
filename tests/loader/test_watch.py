"""A loader worker that falls silent is an error naming the rank, the worker and the shard it
reads, within --loader-timeout (raywds.loader.watch), not a rank waiting until the process-group
timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.runs import small_config

from raywds.data.manifest import read_manifest
from raywds.loader.loader import train_loader, val_loader
from raywds.loader.watch import LoaderStalled
from raywds.plan.modes import epoch_plan
from raywds.world import World


def stalling(shards: Path, tmp_path: Path, stalled: str) -> Path:
    """The manifest of `shards` with its shards behind a command that hangs on `stalled` (as a
    reader stuck inside a storage client's call would, below any read timeout)."""
    (tmp_path / "manifest.json").write_bytes((shards / "manifest.json").read_bytes())
    (tmp_path / "fetch").write_text(f'#!/bin/sh\n[ "$1" = "{stalled}" ] && exec sleep 20\nexec cat "{shards}/$1"\n')
    (tmp_path / "fetch").chmod(0o755)
    return tmp_path


def test_a_silent_loader_worker_is_an_error_naming_rank_worker_and_shard(shards: Path, tmp_path: Path) -> None:
    manifest = read_manifest(str(shards))
    stalled = manifest.shards("train")[5].name
    data = stalling(shards, tmp_path, stalled)
    cfg = small_config(data, mode="split", shards_at=f"pipe:{data}/fetch {{}}", loader_workers=2, loader_timeout=1.0)
    manifest = read_manifest(str(data), shards_at=cfg.shards_at)
    world = World(rank=1, world_size=2)
    plan = epoch_plan(manifest, cfg, 2, epoch=0)
    start = time.monotonic()
    with pytest.raises(LoaderStalled) as error:
        for _ in train_loader(manifest, cfg.loader(), world, plan, epoch=0):
            pass
    assert time.monotonic() - start < 20
    message = str(error.value)
    assert message.startswith("rank 1: loader worker ") and "delivered no batch for 1 s (--loader-timeout)" in message
    assert message.endswith(f"it was reading pipe:{data}/fetch {stalled}"), message


def test_a_healthy_loader_is_not_cut_by_the_timeout(shards: Path) -> None:
    """Each batch well within the timeout: no error, every sample (the timeout is per batch, not per epoch)."""
    cfg = small_config(shards, mode="split", loader_workers=2, loader_timeout=5.0)
    manifest = read_manifest(str(shards))
    seen = sum(len(b.keys) for b in val_loader(manifest, cfg.loader(), World()))
    assert seen == manifest.num_samples("val")
