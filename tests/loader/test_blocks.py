"""Shared-memory blocks reused between batches (raywds.loader.blocks), through a real DataLoader
worker: a block is written again only once nothing in the training process refers to it."""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from functools import partial as bind
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from raywds.data.manifest import read_manifest
from raywds.loader.blocks import SLOTS, Blocks
from raywds.loader.loader import _loader, train_loader
from raywds.loader.pool import Pool
from raywds.loader.stages import Skips
from raywds.loader.watch import Whereabouts
from raywds.plan.modes import epoch_plan
from raywds.train.config import TrainConfig
from raywds.world import World

BATCH = 4


def numbered_samples(count: int) -> Iterator[dict[str, object]]:
    return ({"__key__": f"k{i}", "__url__": "n", "__id__": i, "jpg": i, "cls": b"0"} for i in range(count))


def numbered(number: int, sample_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """An image whose pixels all equal its number (mod 251), so an overwrite shows; written
    into its batch slot when given one, as the `cpu` decoder does."""
    image = torch.full((3, 6, 6), number % 251, dtype=torch.uint8)
    return image if out is None else out.copy_(image)


def loader(count: int, decode: str = "cpu"):  # type: ignore[no-untyped-def]
    """`cpu` decoding fills the batch slots; `pil` decoding's images are stacked into a block."""
    cfg = TrainConfig(
        data="unused",
        model="demo",
        batch_size=BATCH,
        loader_workers=1,
        image_size=6,
        decode=decode,
    ).loader()
    skips = Skips(cfg.read_policy(skip_unreadable=False))
    pool = Pool(World(), timeout=cfg.loader_timeout)
    pool.warm(1)  # the worker's blocks are the pool's: watch them before its pipeline is sent
    leases: list[tuple[int, int] | None] = []
    blocks = pool.members[0].blocks
    watch = blocks.watch

    def spy(lease, images):  # type: ignore[no-untyped-def]
        leases.append(tuple(lease))
        watch(lease, images)

    blocks.watch = spy  # type: ignore[method-assign]
    stages = [bind(numbered_samples, count)]
    handed = _loader(stages, numbered, cfg, World(), Whereabouts(), partial=False, skips=skips, pool=pool)
    return handed, leases


def expected(batch_index: int) -> torch.Tensor:
    return torch.arange(batch_index * BATCH, (batch_index + 1) * BATCH) % 251


@pytest.mark.parametrize("decode", ["cpu", "pil"])
def test_blocks_are_reused_once_the_batches_are_dropped(decode: str) -> None:
    handed, leases = loader(60 * BATCH, decode)
    for i, batch in enumerate(handed):
        assert torch.equal(batch.images.amax(dim=(1, 2, 3)), expected(i))
    assert len(leases) == 60, "every batch arrives in a reused block, none in a fresh one"
    assert len(set(leases)) <= 6, f"a few blocks go round: {sorted(set(leases))}"


@pytest.mark.parametrize("decode", ["cpu", "pil"])
def test_a_block_is_not_reused_while_a_view_of_it_lives(decode: str) -> None:
    handed, leases = loader(40 * BATCH, decode)
    held = []
    for i, batch in enumerate(handed):
        if i < 2 * SLOTS:
            held.append((i, batch.images[1:3]))  # a view keeps the whole block
        elif i == 2 * SLOTS:  # by now the worker has made more batches than it has blocks
            for j, view in held:
                assert torch.equal(view.amax(dim=(1, 2, 3)), expected(j)[1:3]), f"batch {j} was overwritten"
            assert len(leases) == SLOTS, "with every block held, the worker takes fresh ones"
            held.clear()
    assert len(leases) > SLOTS + 10, "once the views died, the blocks go round again"


def test_cross_worker_shuffle_keeps_its_samples_intact(shards: Path) -> None:
    """The shuffle splits batches into per-sample views that outlive the batch: the same
    seeded epoch, consumed while holding everything and while dropping every batch, gives the
    same pixels for every sample."""
    cfg = TrainConfig(
        data=str(shards),
        model="demo",
        batch_size=8,
        image_size=24,
        loader_workers=2,
        cross_worker_shuffle_buffer=24,
        batches_per_epoch=12,
    )
    manifest = read_manifest(str(shards))
    plan = epoch_plan(manifest, cfg, 1, epoch=0)

    def run(hold: bool) -> dict[tuple[int, int], torch.Tensor]:
        torch.manual_seed(0)  # the workers' crops
        kept, pixels = [], {}
        for i, batch in enumerate(train_loader(manifest, cfg.loader(), World(), plan, epoch=0)):
            for j in range(len(batch.keys)):
                pixels[i, j] = batch.images[j].clone()
            if hold:
                kept.append(batch)
        return pixels

    held, dropped = run(hold=True), run(hold=False)
    for key, image in held.items():
        assert torch.equal(image, dropped[key]), f"batch {key[0]} sample {key[1]} differs"


def test_spawned_workers_get_the_shared_flags_only() -> None:
    blocks = Blocks(2)
    blocks.busy[1, 3] = 1
    out = io.BytesIO()
    ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(blocks)
    copy = pickle.loads(out.getvalue())
    assert copy.busy.shape == (2, SLOTS) and int(copy.busy[1, 3]) == 1 and copy._watched == {}
    copy.busy[0, 0] = 1
    assert int(blocks.busy[0, 0]) == 1, "the flags are the same shared memory"


def test_a_lease_pin_memory_turned_into_a_list_frees_its_block_only() -> None:
    """DataLoader's pin_memory (CUDA runs) hands tuples back as lists."""
    blocks = Blocks(2)
    blocks.busy.fill_(1)
    images = torch.zeros(4, dtype=torch.uint8)
    blocks.watch([1, 2], images)  # type: ignore[arg-type]
    blocks.release()
    assert int(blocks.busy.sum()) == blocks.busy.numel(), "busy while the images live"
    del images
    blocks.release()
    assert int(blocks.busy[1, 2]) == 0 and int(blocks.busy.sum()) == blocks.busy.numel() - 1


def test_passes_left_unfinished_give_their_blocks_back() -> None:
    """An epoch may end before its workers' streams do (resample): torch drops the batches the
    worker had made ahead, which never reach the training process to be watched and freed. The
    next pass frees their blocks, so every batch of later passes still comes in a reused one."""
    handed, leases = loader(40 * BATCH)
    for _ in range(5):  # more than SLOTS blocks would be lost by now, a few each pass
        for i, _batch in enumerate(handed):
            if i == 2:
                break
    assert len(leases) == 15
    assert sum(1 for _batch in handed) == 40
    assert len(leases) == 15 + 40, "the last pass's batches all come in reused blocks"
