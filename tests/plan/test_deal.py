"""`deal`, the split plan's balance of shards over slots: the same deal as the straightforward
scan of every slot for every shard (which plans and checkpoints were made with), in
O(shards x log slots) rather than O(shards x slots)."""

from __future__ import annotations

import random
import time

import pytest

from raywds.data.manifest import ShardInfo, deal
from raywds.plan import epoch
from raywds.plan.split import Split


def scanned(shards: list[ShardInfo], num_slots: int) -> list[list[ShardInfo]]:
    """The deal as first written: every shard, largest first, to the least (samples, shards, index) slot."""
    slots: list[list[ShardInfo]] = [[] for _ in range(num_slots)]
    load = [0] * num_slots
    for i in sorted(range(len(shards)), key=lambda i: -shards[i].num_samples):
        lightest = min(range(num_slots), key=lambda s: (load[s], len(slots[s]), s))
        slots[lightest].append(shards[i])
        load[lightest] += shards[i].num_samples
    return slots


def synthetic(count: int, rng: random.Random, sizes: list[int]) -> list[ShardInfo]:
    return [ShardInfo(f"s-{i:06d}.tar", rng.choice(sizes), 0, "") for i in range(count)]


@pytest.mark.parametrize("seed", range(40))
def test_the_deal_is_the_scanned_deal(seed: int) -> None:
    """Ties everywhere (a few sizes, empty shards, more slots than shards) and none."""
    rng = random.Random(seed)
    sizes = rng.choice([[1000], [0, 1, 2], [999, 1000, 1001, 250], list(range(1, 5000))])
    shards = synthetic(rng.randint(0, 300), rng, sizes)
    rng.shuffle(shards)
    num_slots = rng.choice([1, 2, 3, 7, 8, 64, 500])
    assert deal(shards, num_slots) == scanned(shards, num_slots)


def test_a_split_plan_is_the_one_the_scanned_deal_made() -> None:
    """The whole plan (ranks, then each rank's workers), as checkpoints made before recorded it."""
    shards = synthetic(1282, random.Random(7), [1251, 1252, 1300, 400])
    plan = Split().plan(shards, num_ranks=16, num_workers=4, batch_size=32, seed=3, epoch=2)
    order = [s for s in shards if s.num_samples > 0]
    from raywds.plan import seeds

    seeds.rng(seeds.SHARD_ORDER, 3, 2).shuffle(order)
    assert plan.slots == [slot for ranked in scanned(order, 16) for slot in scanned(ranked, 4)]


def best_of(runs: int, shards: list[ShardInfo], num_slots: int) -> float:
    times = []
    for _ in range(runs):
        started = time.process_time()  # this process's CPU: other work on a busy machine does not count
        deal(shards, num_slots)
        times.append(time.process_time() - started)
    return min(times)


def test_dealing_to_8x_the_slots_takes_well_under_8x_the_time() -> None:
    """The scan took 8x as long for 8x the slots; the heap about 1.3x (log slots). A ratio, so
    that a slower machine does not fail it; CPU seconds, best of 3, so that a busy one does not."""
    shards = synthetic(50_000, random.Random(1), list(range(900, 1100)))
    small, large = best_of(3, shards, 512), best_of(3, shards, 4096)
    assert large / small < 2.5, f"{small:.3f} s on 512 slots, {large:.3f} s on 4096"


def test_a_rank_deals_only_its_own_workers_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank builds what it reads: its shards to its workers, no other rank's (the plan's slots
    are dealt when asked for), and the same slots as a plan that dealt them all."""
    shards = synthetic(2000, random.Random(3), [999, 1000, 1001, 250])
    whole = Split().plan(shards, num_ranks=64, num_workers=8, batch_size=32, seed=1, epoch=1)
    expected = [list(slot) for slot in whole.slots]
    dealt: list[int] = []
    real = epoch.deal
    monkeypatch.setattr(epoch, "deal", lambda shards, n: dealt.append(len(shards)) or real(shards, n))
    plan = Split().plan(shards, num_ranks=64, num_workers=8, batch_size=32, seed=1, epoch=1)
    mine = [plan.slot(5, w) for w in range(8)] + [plan.slot(5, 0)]
    assert mine == expected[40:48] + [expected[40]]
    assert len(dealt) == 1 and dealt[0] == sum(len(slot) for slot in expected[40:48])
    assert plan.samples_per_rank == whole.samples_per_rank and len(plan.slots) == 64 * 8


@pytest.mark.parametrize("seed", range(20))
def test_idle_workers_are_counted_without_dealing(seed: int) -> None:
    rng = random.Random(seed)
    shards = synthetic(rng.randint(1, 200), rng, rng.choice([[1000], [1, 5000, 20], list(range(1, 3000))]))
    plan = Split().plan(shards, num_ranks=rng.choice([1, 3, 16]), num_workers=rng.choice([1, 4, 8]), batch_size=8)
    idle = plan.slots.idle()
    assert idle == sum(1 for slot in list(plan.slots) if not slot)
