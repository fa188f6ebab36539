"""The Ray Data plane's steps without Ray (raywds.loader.plane): read tasks over groups of shards
that shuffle the encoded samples, seeded, and decode them into blocks of whole batches; the rank
taking a whole block as a batch without a copy; its thread of batches made ahead."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from support.runs import small_config

from raywds.data.manifest import ShardInfo, read_manifest
from raywds.loader.loader import expected
from raywds.loader.plane import Rebatcher, ahead, groups, task_blocks
from raywds.loader.stages import train_decoder

BATCH = 8


def blocks(shards: Path, seed: int | None, consumed: dict[str, np.ndarray] | None = None) -> list[dict]:
    """One read task over the first three training shards."""
    cfg = small_config(shards, batch_size=BATCH, image_size=16).loader()
    manifest = read_manifest(str(shards))
    wanted = expected(manifest, "train")
    reads = [(url, wanted[url], (consumed or {}).get(url)) for url in list(wanted)[:3]]
    policy = cfg.read_policy(skip_unreadable=False)
    decoder = train_decoder(cfg, epoch=0)
    return list(task_blocks(reads, decoder, policy, size=16, batch_size=BATCH, shuffle_seed=seed))


def ids(made: list[dict]) -> list[int]:
    return [int(i) for block in made for i in block["id"]]


def test_a_read_task_makes_blocks_of_whole_batches_of_its_shards_samples_shuffled_by_its_seed(shards: Path) -> None:
    plain, once, again, other = blocks(shards, None), blocks(shards, 1), blocks(shards, 1), blocks(shards, 2)
    assert [len(b["id"]) for b in once[:-1]] == [BATCH] * (len(once) - 1) and 1 <= len(once[-1]["id"]) <= BATCH
    assert ids(plain) == sorted(ids(plain)), "no seed: the shards' own order"
    assert sorted(ids(once)) == ids(plain), "every sample of the task's shards once"
    assert ids(once) == ids(again), "the same seed, the same order"
    assert ids(once) != ids(plain) and ids(once) != ids(other)
    first_shard = set(ids(plain)[: len(ids(plain)) // 3])
    assert not first_shard >= set(ids(once)[:BATCH]), "the shards are shuffled together, not one after the other"
    crops = {int(i): image for block in once for i, image in zip(block["id"], block["image"])}
    for block in again:
        for i, image in zip(block["id"], block["image"]):
            assert np.array_equal(crops[int(i)], image), "a sample's crop is its own, wherever the shuffle puts it"


def test_a_resumed_read_task_leaves_out_what_was_trained_on(shards: Path) -> None:
    manifest = read_manifest(str(shards))
    first = next(iter(expected(manifest, "train").items()))
    url, shard = first
    done = np.zeros(shard.num_samples, dtype=bool)
    done[::2] = True
    made = ids(blocks(shards, 3, {url: done}))
    trained = {shard.first_id + i for i in np.flatnonzero(done)}
    assert not trained & set(made) and len(made) == len(ids(blocks(shards, 3))) - len(trained)


@pytest.mark.parametrize(
    "sizes, buffer, tasks",
    [([100] * 12, 0, 12), ([100] * 12, 250, 4), ([100] * 12, 10_000, 4), ([1000] * 3, 1000, 3), ([], 100, 0)],
)
def test_groups_hold_the_shuffle_buffer_and_leave_tasks_to_run_side_by_side(
    sizes: list[int], buffer: int, tasks: int
) -> None:
    shards = [ShardInfo(name=f"s{i}", num_samples=n, num_bytes=0, sha256="") for i, n in enumerate(sizes)]
    made = groups(shards, buffer)
    assert len(made) == tasks and [s for g in made for s in g] == shards


def test_a_whole_block_is_a_batch_without_a_copy() -> None:
    n = 2 * BATCH
    block = {
        "image": np.random.default_rng(0).integers(0, 255, (BATCH, 4, 4, 3), dtype=np.uint8),
        "label": np.zeros(BATCH, dtype=np.int64),
        "id": np.arange(BATCH),
        "key": np.array([f"k{i}" for i in range(BATCH)], dtype=object),
        "error": np.array([""] * BATCH, dtype=object),
    }
    rest = {k: v[: n - BATCH - 3] for k, v in block.items()}
    batches = list(Rebatcher(BATCH, partial=True)([block, rest]))
    assert [len(b.keys) for b in batches] == [BATCH, n - BATCH - 3]
    assert batches[0].images.data_ptr() == block["image"].ctypes.data, "the block's own memory"


def test_batches_made_ahead_come_in_order_and_an_error_at_its_place() -> None:
    def made() -> Iterator[int]:
        yield from range(5)
        raise ValueError("shard 7 is bad")

    got = []
    with pytest.raises(ValueError, match="shard 7"):
        for item in ahead(made(), depth=2, each=lambda x: x * 10):
            got.append(item)
    assert got == [0, 10, 20, 30, 40]


def test_closing_batches_made_ahead_stops_the_thread_and_its_stream() -> None:
    closed = threading.Event()

    def endless() -> Iterator[int]:
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    stream = ahead(endless(), depth=3)
    assert [next(stream) for _ in range(4)] == [0, 1, 2, 3]
    time.sleep(0.1)  # it has filled its queue by now, and waits
    stream.close()
    assert closed.wait(5), "the source is closed once the result is"
    assert not any(t.name == "raywds-plane-ahead" and t.is_alive() for t in threading.enumerate())
