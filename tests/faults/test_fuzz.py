"""200 seeded random corruptions of a 3-shard dataset (bytes flipped, the file cut short, two
members swapped), each read by the split-mode loader with --verify-hashes, in this process. Every
case must end, within 10 s, in a raywds error naming the shard, and the sample too when the
loader blames one: none may be read silently."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import pytest
from support import shardedit as edit

from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import read_manifest
from raywds.errors import RaywdsError
from raywds.loader.loader import train_loader
from raywds.loader.stages import SampleError
from raywds.plan.modes import epoch_plan
from raywds.train.config import TrainConfig
from raywds.world import World

pytestmark = pytest.mark.faults

NUM_CASES = 200


@pytest.fixture(scope="module")
def three_shards(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "shards"
    convert(tree, out, ConvertOptions(maxcount=40, seed=5))
    assert len(read_manifest(str(out)).shards("train")) == 3
    return out


def flip(data: bytearray, rng: random.Random) -> str:
    places = sorted(rng.sample(range(len(data)), rng.randint(1, 8)))
    for place in places:
        data[place] ^= rng.randint(1, 255)
    return f"flipped bytes at {places}"


def cut(data: bytearray, rng: random.Random) -> str:
    size = rng.randrange(len(data))
    del data[size:]
    return f"cut to {size} bytes"


def swap(data: bytearray, rng: random.Random, path: Path) -> str:
    """Two members (header and data blocks) change places."""
    spans = [(offset - 512, offset + -(-size // 512) * 512) for _, offset, size in edit.member_offsets(path)]
    a, b = sorted(rng.sample(range(len(spans)), 2))
    (a0, a1), (b0, b1) = spans[a], spans[b]
    data[a0:b1] = data[b0:b1] + data[a1:b0] + data[a0:a1]
    return f"swapped members {a} and {b}"


def corrupt(shards: Path, seed: int) -> tuple[str, str]:
    """Damage one train shard of `shards` as seed `seed` says; (its name, what was done)."""
    rng = random.Random(seed)
    name = rng.choice(edit.manifest(shards)["splits"]["train"]["shards"])["name"]
    path = shards / name
    data = bytearray(path.read_bytes())
    kind = rng.choice(["flip", "cut", "swap"])
    done = flip(data, rng) if kind == "flip" else cut(data, rng) if kind == "cut" else swap(data, rng, path)
    path.write_bytes(bytes(data))
    return name, done


def read_epoch(shards: Path) -> int:
    cfg = TrainConfig(
        data=str(shards),
        mode="split",
        batch_size=8,
        image_size=16,
        loader_workers=0,
        verify_hashes=True,
    )
    manifest = read_manifest(str(shards))
    loader = train_loader(manifest, cfg.loader(), World(), epoch_plan(manifest, cfg, 1, epoch=0), epoch=0)
    return sum(len(batch.keys) for batch in loader)


def test_the_clean_dataset_reads_whole(three_shards: Path) -> None:
    assert read_epoch(three_shards) == 120


@pytest.mark.timeout(600)
def test_no_corruption_is_read_silently(three_shards: Path, tmp_path: Path) -> None:
    slowest = 0.0
    kinds: dict[str, int] = {}
    for seed in range(NUM_CASES):
        case = tmp_path / f"case{seed}"
        shutil.copytree(three_shards, case)
        name, done = corrupt(case, seed)
        start = time.monotonic()
        with pytest.raises(RaywdsError) as caught:
            read_epoch(case)
        seconds = time.monotonic() - start
        slowest = max(slowest, seconds)
        message = str(caught.value)
        assert seconds < 10, f"seed {seed} ({name}: {done}) took {seconds:.1f} s"
        assert f"shard {case / name}" in message, f"seed {seed} ({name}: {done}) gave: {message}"
        if isinstance(caught.value, SampleError):
            assert " sample " in message, message
        kinds[type(caught.value).__name__] = kinds.get(type(caught.value).__name__, 0) + 1
        shutil.rmtree(case)
    print(f"{NUM_CASES} corruptions, slowest {slowest:.2f} s, errors {kinds}")
