"""The Ray Data plane (raywds.launch.raydata) on a private local Ray, its ranks driven one by one
as training drives them: split epochs exact with 2 and 3 ranks on uneven shards, resample
epochs of equal full batches, a resumed epoch giving exactly the rest, exact validation, and
each sample's crop the same as the per-rank loader's."""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.data import made_shards, tar_keys
from support.runs import small_config

from raywds.data.manifest import read_manifest
from raywds.loader.loader import PerRank
from raywds.loader.stages import Batch
from raywds.plan.modes import epoch_plan
from raywds.plan.position import Position, done_in
from raywds.train.config import TrainConfig
from raywds.world import World

pytestmark = pytest.mark.ray


def plane_config(data: Path, **overrides: object) -> TrainConfig:
    # No DataLoader workers under the plane: one slot per rank.
    return small_config(data, **{"batch_size": 8, "loader_workers": 0, **overrides})


def run_epoch(
    data: Path, cfg: TrainConfig, world_size: int, epoch: int = 0, position: Position | None = None, loaders=None
) -> list[list[Batch]]:
    """Every rank's batches of `epoch` from `loaders` (the plane unless given), checked against the plan's counts."""
    from raywds.launch import raydata  # Ray Data: imported where used, not in every collection

    loaders = loaders if loaders is not None else raydata.RayData(raydata.Plane())
    manifest = read_manifest(cfg.data, shards_at=cfg.shards_at)
    plan = epoch_plan(manifest, cfg, world_size, epoch=epoch, done=done_in(position, epoch))
    ranks = []
    for rank in range(world_size):
        loader = loaders.train(
            manifest,
            cfg.loader(),
            World(rank=rank, world_size=world_size),
            plan,
            epoch=epoch,
            position=position,
        )
        batches = list(loader)
        assert len(batches) == len(loader) == plan.batches_per_rank[rank], f"rank {rank}: the plan's batch count"
        ranks.append(batches)
    return ranks


def keys(ranks: list[list[Batch]]) -> Counter:
    return Counter(k for batches in ranks for b in batches for k in b.keys)


@pytest.mark.parametrize(
    "world_size, reader, executor",
    [(2, "file", "rank"), (3, "file", "rank"), (2, "pipe", "rank"), (3, "file", "feeder")],
)
def test_split_epochs_are_exact_on_uneven_shards(
    uneven: Path, local_ray: None, world_size: int, reader: str, executor: str
) -> None:
    """Shards read from files, or through a `pipe:` command (as from object storage); each rank's
    executor in its own process, or in a feeder actor of its own."""
    from raywds.launch import raydata

    cfg = plane_config(uneven, mode="split", shards_at=f"pipe:cat {uneven}/{{}}" if reader == "pipe" else None)
    loaders = raydata.RayData(raydata.Plane(executor=executor))
    for epoch in (0, 1):
        ranks = run_epoch(uneven, cfg, world_size, epoch, loaders=loaders)
        assert keys(ranks) == Counter(tar_keys(uneven)), f"epoch {epoch}: every sample exactly once"
        sizes = [len(b.keys) for r in ranks for b in r[:-1]]
        assert set(sizes) == {8}, "every batch but a rank's last is full"
        for r in ranks:
            assert r[-1].images.shape[1:] == (3, 28, 28) and r[-1].images.dtype == torch.uint8
            assert 2 <= len(r[-1].keys) <= 9, "a rest of one sample joins the batch before"
    if executor == "feeder":
        import ray

        assert ray.get(loaders.feeder().__ray_call__.remote(lambda self: os.getpid())) != os.getpid()
    loaders.close()


def test_a_samples_crop_is_the_per_rank_loaders(uneven: Path, local_ray: None) -> None:
    cfg = plane_config(uneven, mode="split", worker_shuffle_buffer=50)
    plane = run_epoch(uneven, cfg, 2, epoch=1)
    loader = run_epoch(uneven, dataclasses.replace(cfg, loader_workers=2), 2, epoch=1, loaders=PerRank())
    by_id = {int(i): b.images[j] for r in loader for b in r for j, i in enumerate(b.ids)}
    seen = 0
    for r in plane:
        for b in r:
            for j, i in enumerate(b.ids):
                assert torch.equal(b.images[j], by_id[int(i)]), f"sample {int(i)}: the plane's crop differs"
                seen += 1
    assert seen == 120


def test_resample_epochs_give_every_rank_equal_full_batches(shards: Path, local_ray: None) -> None:
    from raywds.launch import raydata

    cfg = plane_config(shards, mode="resample")
    ranks = run_epoch(shards, cfg, 3)
    assert [len(r) for r in ranks] == [5, 5, 5]  # ceil(120 / (3 x 8))
    assert all(len(b.keys) == 8 for r in ranks for b in r)
    manifest = read_manifest(str(shards))
    plan = epoch_plan(manifest, cfg, 3, epoch=0)
    train = manifest.shards("train")  # ids are numbered through the split in manifest order
    offsets = {
        s.name: first for s, first in zip(train, itertools.accumulate((s.num_samples for s in train), initial=0))
    }
    seen = []
    for rank, batches in enumerate(ranks):
        draws = plan.mode.shards_for(plan, manifest.shards("train"), rank=rank, worker=0, seed=0, epoch=0)
        drawn = raydata._enough(draws, plan.samples_per_rank[rank])
        allowed = {offsets[s.name] + i for s in drawn for i in range(s.num_samples)}
        ids = {int(i) for b in batches for i in b.ids}
        assert ids <= allowed, f"rank {rank} trained on samples of shards it did not draw"
        seen.append(ids)
    assert seen[0] != seen[1] != seen[2], "ranks draw their own shards"


def test_a_resumed_split_epoch_gives_exactly_the_rest(uneven: Path, local_ray: None) -> None:
    cfg = plane_config(uneven, mode="split")
    manifest = read_manifest(str(uneven))
    consumed = np.zeros(120, dtype=bool)
    consumed[np.random.default_rng(0).choice(120, size=50, replace=False)] = True
    position = Position.of_flags(
        consumed,
        manifest.shards("train"),
        mode=epoch_plan(manifest, cfg, 2, epoch=0).mode,
        epoch=0,
        step=3,
        samples_done=50,
        dataset=manifest.fingerprint("train"),
    )
    ranks = run_epoch(uneven, cfg, 3, 0, position)
    ids = sorted(int(i) for r in ranks for b in r for i in b.ids)
    assert ids == sorted(np.flatnonzero(~consumed).tolist()), "the 70 samples not yet trained on, once each"


def test_validation_through_the_plane_is_exact(shards: Path, local_ray: None) -> None:
    from raywds.launch import raydata

    cfg = plane_config(shards)
    plane = raydata.RayData(raydata.Plane())
    manifest = read_manifest(str(shards))
    seen = Counter(
        k
        for rank in range(3)
        for b in plane.val(manifest, cfg.loader(), World(rank=rank, world_size=3))
        for k in b.keys
    )
    assert seen == Counter(tar_keys(shards, "val"))


@pytest.fixture(scope="module")
def ten_thousand(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10,000 training samples (10 classes of 1,000 small JPEGs) in 20 shards."""
    from raywds.data.convert import ConvertOptions
    from raywds.data.demo import DemoSpec

    spec = DemoSpec(num_train_per_class=1000, num_val_per_class=1, image_side_px=32, seed=1)
    return made_shards(tmp_path_factory, "tree10k", spec, ConvertOptions(maxcount=500, seed=0))


def test_an_epoch_stays_within_the_object_store_bound(ten_thousand: Path, local_ray: None) -> None:
    """A slow rank (the trainer) and faster decode tasks: with the default settings the pipeline
    stops at its object store budget (--plane-store-mb, 1024 MB) rather than fill the store with
    the epoch's 1.5 GB of decoded crops (1.2 GB measured without a budget), and never spills."""
    from raywds.launch import raydata

    cfg = plane_config(ten_thousand, mode="split", batch_size=64, image_size=224)
    plane = raydata.Plane()
    budget_mb = plane.object_store_bytes_per_rank / 2**20
    before, spilled_before = raydata.store_use()
    peak, stop = [before], threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            peak.append(raydata.store_use()[0])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        manifest = read_manifest(str(ten_thousand))
        plan = epoch_plan(manifest, cfg, 1, epoch=0)
        count = 0
        for batch in raydata.RayData(plane).train(manifest, cfg.loader(), World(), plan, epoch=0):
            count += len(batch.keys)
            time.sleep(0.1)  # the step: slower than the decode tasks
    finally:
        stop.set()
        watcher.join()
    assert count == 10_000
    grown = (max(peak) - before) / 2**20
    assert grown <= budget_mb, f"the object store grew by {grown:.0f} MB, past the budget of {budget_mb:.0f} MB"
    assert raydata.store_use()[1] == spilled_before, "nothing spilled"


def broken_copy(shards: Path, tmp_path: Path, index: int = 2) -> tuple[Path, str, Any]:
    """A copy of `shards` whose training shard `index` has one member that is not an image: the
    folder, the shard's name and the member (a TarInfo)."""
    import json
    import shutil
    import tarfile

    data = tmp_path / "shards"
    shutil.copytree(shards, data)
    shard = json.loads((data / "manifest.json").read_text())["splits"]["train"]["shards"][index]["name"]
    with tarfile.open(data / shard) as tar:  # the same size, so the manifest's byte count still holds
        member = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))
    raw = bytearray((data / shard).read_bytes())
    raw[member.offset_data : member.offset_data + member.size] = b"x" * member.size
    (data / shard).write_bytes(bytes(raw))
    return data, shard, member


def test_a_bad_sample_in_split_mode_is_raywdss_one_line(shards: Path, tmp_path: Path, local_ray: None) -> None:
    """A member that is not an image, decoded in a Ray Data task: the rank raises raywds's own
    SampleError naming shard and sample, not Ray's wrapped traceback."""
    from raywds.loader.stages import SampleError

    data, shard, member = broken_copy(shards, tmp_path)
    with pytest.raises(SampleError) as caught:
        run_epoch(data, plane_config(data, mode="split"), 2)
    line = str(caught.value)
    assert "\n" not in line and "Traceback" not in line, line
    key, name = member.name.rsplit(".", 1)[0], re.escape(member.name)
    assert re.fullmatch(
        rf"shard \S+/{re.escape(shard)}: sample {re.escape(key)} \({name}\): cannot identify image file", line
    )


def test_resample_mode_skips_a_bad_sample_and_hands_its_reason_on(
    shards: Path, tmp_path: Path, local_ray: None
) -> None:
    cfg = plane_config(shards, mode="resample", batches_per_epoch=6, max_bad_samples=10)
    manifest = read_manifest(str(shards))
    plan = epoch_plan(manifest, cfg, 1, epoch=0)
    first = next(plan.mode.shards_for(plan, manifest.shards("train"), rank=0, worker=0, seed=0, epoch=0))
    data, _, _ = broken_copy(shards, tmp_path, manifest.shards("train").index(first))  # a shard the rank reads
    ranks = run_epoch(data, dataclasses.replace(cfg, data=str(data)), 1)
    assert all(len(b.keys) == 8 for b in ranks[0]), "batches stay full"
    reasons = [r for b in ranks[0] for r in b.bad_samples]
    assert reasons and all("cannot identify image file" in r.reason for r in reasons), reasons
    assert len({(r.shard, r.key) for r in reasons}) == 1, "every draw of the one bad sample is that sample"


def test_resample_mode_stops_when_no_drawn_shard_can_be_read(shards: Path, tmp_path: Path, local_ray: None) -> None:
    """Unreadable shards are skipped in resample mode, but a round in which none could be read
    (the server is down) is an error, not an endless loop."""
    from raywds.errors import ShardError
    from raywds.serve import free_port

    down = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    cfg = plane_config(shards, mode="resample", shards_at=down, read_retries=0, read_timeout=2)
    with pytest.raises(ShardError, match=r"rank 0: none of the \d+ shards drawn could be read, the last: shard http"):
        run_epoch(shards, cfg, 1)
