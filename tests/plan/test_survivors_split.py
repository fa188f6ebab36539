"""Split mode's deal to the letter: the canonical nodes and each node's shuffle seeded by the
streams of raywds.plan.seeds, a world that does not fill whole nodes, empty and one-sample shards,
and the edges of what its report and findings say (10% spread, a spare sample, six name runs)."""

from __future__ import annotations

from typing import Any

import pytest

from raywds.data.manifest import ShardInfo, deal
from raywds.plan import seeds
from raywds.plan.checks import check
from raywds.plan.epoch import Done, Finding, Nodes
from raywds.plan.render import render
from raywds.plan.split import Split, canonical, node_deal


def shards_of(sizes: list[int]) -> list[ShardInfo]:
    return [ShardInfo(f"s-{i:04d}.tar", n, 0, "") for i, n in enumerate(sizes)]


def test_canonical_nodes_are_the_shards_shuffled_by_the_canonical_stream_then_dealt() -> None:
    shards = shards_of([10] * 12)  # equal sizes: the shuffled order alone decides the deal
    order = list(shards)
    seeds.rng(seeds.CANONICAL, 4).shuffle(order)
    expected = {s.name: group for group, members in enumerate(deal(order, 3)) for s in members}
    assert canonical(shards, 3, seed=4) == expected


def expected_node_deal(shards: list[ShardInfo], count: int, per_node: int, *, canon: int, seed: int, epoch: int):
    home = canonical(shards, canon, seed)
    by_rank = []
    for node in range(count):
        mine = [s for s in shards if s.num_samples > 0 and home[s.name] % count == node]
        seeds.rng(seeds.SHARD_ORDER, seed, epoch, node).shuffle(mine)
        by_rank += deal(mine, per_node)
    return by_rank


def test_each_node_shuffles_its_shards_by_seed_epoch_and_node_then_deals_them_to_its_ranks() -> None:
    shards = shards_of([10] * 24)
    dealt = node_deal(shards, shards, 4, Nodes(canonical=4, ranks_per_node=2), seed=3, epoch=2)
    assert dealt == expected_node_deal(shards, 2, 2, canon=4, seed=3, epoch=2)
    assert dealt != node_deal(shards, shards, 4, Nodes(canonical=4, ranks_per_node=2), seed=3, epoch=3)


def test_a_world_that_does_not_fill_whole_nodes_counts_each_rank_as_a_node() -> None:
    shards = shards_of([10] * 18)
    plan = Split().plan(shards, num_ranks=3, num_workers=1, batch_size=4, seed=1, epoch=0, nodes=Nodes(6, 2))
    assert plan.slots.by_rank == expected_node_deal(shards, 3, 1, canon=6, seed=1, epoch=0)
    assert plan.samples_per_rank == [60, 60, 60]


@pytest.mark.parametrize("nodes", [None, Nodes(canonical=2, ranks_per_node=1)])
def test_empty_shards_are_dealt_to_no_slot_and_one_sample_shards_are(nodes: Nodes | None) -> None:
    shards = shards_of([0, 1, 5, 0, 1, 7])
    plan = Split().plan(shards, num_ranks=2, num_workers=1, batch_size=4, seed=1, nodes=nodes)
    assert sorted(s.name for slot in plan.slots for s in slot) == [
        "s-0001.tar",
        "s-0002.tar",
        "s-0004.tar",
        "s-0005.tar",
    ]


def test_a_plan_without_an_epoch_is_epoch_zeros() -> None:
    shards = shards_of([10] * 30)
    assert Split().plan(shards, num_ranks=3, num_workers=2, batch_size=4, seed=1).slots == (
        Split().plan(shards, num_ranks=3, num_workers=2, batch_size=4, seed=1, epoch=0).slots
    )


def test_a_split_plan_resumes_only_from_per_shard_counts() -> None:
    with pytest.raises(AssertionError, match=r"^a split epoch resumes from its per-shard counts$"):
        Split().plan(shards_of([10] * 4), num_ranks=2, num_workers=1, batch_size=4, done=Done(5))


def warned(sizes: list[int], **plan: Any) -> list[Finding]:
    made = Split().plan(shards_of(sizes), seed=1, epoch=0, **plan)
    return [f for f in check(made, num_shards=len(sizes)) if f.level != "note"]


def test_ranks_ten_percent_apart_are_not_uneven_and_eleven_are() -> None:
    assert warned([100, 90], num_ranks=2, num_workers=1, batch_size=10) == []
    assert warned([100, 95], num_ranks=2, num_workers=1, batch_size=10) == []
    assert [f.text[:36] for f in warned([100, 89], num_ranks=2, num_workers=1, batch_size=10)] == [
        "ranks are uneven: 89..100 samples, s"
    ]


def test_a_rank_of_one_sample_has_no_spare_sample() -> None:
    plan = Split().plan(shards_of([9, 1]), num_ranks=2, num_workers=1, batch_size=8, seed=1)
    assert sorted(plan.samples_per_rank) == [1, 9]
    spare = [f.text for f in check(plan, num_shards=2) if "spare" in f.text]
    assert spare == [
        "1 rank(s) end with one spare sample; it joins their previous batch (BatchNorm cannot train on one)"
    ]


def test_a_refusal_with_one_worker_a_rank_offers_no_fewer_workers() -> None:
    plan = Split().plan(shards_of([10]), num_ranks=2, num_workers=1, batch_size=4, seed=1)
    assert [f.text for f in check(plan, num_shards=1) if f.level == "refuse"] == [
        "split mode needs at least one shard per (rank, loader worker): 1 shards < 2 ranks x 1 workers, so 1 "
        "workers would read nothing; reconvert with a smaller --maxcount (about 1, for 20 shards or more per rank "
        "and one or more per worker)"
    ]


def test_ranks_that_get_no_shards_from_the_canonical_nodes_are_warned_of_with_the_fix() -> None:
    found = warned([10] * 4, num_ranks=4, num_workers=1, batch_size=4, nodes=Nodes(1, 2))
    assert (
        Finding(
            "warn",
            "2 of 4 ranks get no shards in this epoch: with --canonical-nodes, give at least as many canonical "
            "nodes as nodes (a multiple of the node count keeps the nodes even)",
        )
        in found
    ), found


def test_as_many_shards_as_slots_with_a_worker_left_idle_is_warned() -> None:
    found = warned([100, 1, 1, 1], num_ranks=2, num_workers=2, batch_size=4)
    assert any(f.level == "warn" and f.text.startswith("1 loader workers get no shard") for f in found), found


def opened(names: list[str], num_ranks: int = 1) -> list[str]:
    shards = [ShardInfo(name, 10, 0, "") for name in names]
    plan = Split().plan(shards, num_ranks=num_ranks, num_workers=1, batch_size=4, seed=1)
    text = render(plan, check(plan, num_shards=len(shards)), gpus_per_node=1)
    return [line for line in text.splitlines() if line.startswith("  rank ")]


def test_a_worker_of_six_runs_of_names_lists_them_all_and_of_seven_lists_six() -> None:
    six = [f"s-{2 * i:04d}.tar" for i in range(6)]
    assert opened(six) == ["  rank 0 worker 0: " + " ".join(sorted(six))]
    seven = [f"s-{2 * i:04d}.tar" for i in range(7)]
    assert opened(seven) == ["  rank 0 worker 0: " + " ".join(sorted(seven)[:6]) + " ... (7 shards)"]


def test_the_report_lists_the_workers_of_the_first_two_ranks_shown() -> None:
    lines = opened([f"s-{i:04d}.tar" for i in range(6)], num_ranks=3)
    assert [line.split(":")[0] for line in lines] == ["  rank 0 worker 0", "  rank 1 worker 0"]
