"""Split mode with --canonical-nodes (raywds.plan.split.node_deal): each node reads the same
shards every epoch, in a new order, every shard once; when the nodes change, whole canonical
nodes move; without the flag, plans are what they always were."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from raywds.data.manifest import ShardInfo, deal, read_manifest
from raywds.plan import seeds
from raywds.plan.epoch import EpochPlan, Nodes
from raywds.plan.modes import epoch_plan
from raywds.plan.split import Split, canonical
from raywds.train.config import TrainConfig
from raywds.world import World

SHARDS = [ShardInfo(f"s-{i:05d}.tar", random.Random(i).randint(20, 80), 1000, "") for i in range(960)]


def plan(ranks: int, epoch: int, nodes: Nodes | None) -> EpochPlan:
    return Split().plan(SHARDS, num_ranks=ranks, num_workers=2, batch_size=8, seed=5, epoch=epoch, nodes=nodes)


def by_node(p: EpochPlan, ranks_per_node: int) -> list[set[str]]:
    """The shard names each node's ranks read (ranks node x ranks_per_node ...)."""
    per_rank = [{s.name for w in range(p.num_workers) for s in p.slot(r, w)} for r in range(p.num_ranks)]
    return [set().union(*per_rank[n : n + ranks_per_node]) for n in range(0, p.num_ranks, ranks_per_node)]


def once(p: EpochPlan) -> None:
    dealt = Counter(s.name for slot in p.slots for s in slot)
    assert dealt == Counter(s.name for s in SHARDS), "every shard exactly once"


def test_each_node_reads_the_same_shards_every_epoch_in_a_new_order() -> None:
    nodes = Nodes(canonical=8, ranks_per_node=4)
    first, second = plan(32, 0, nodes), plan(32, 1, nodes)
    once(first), once(second)
    assert by_node(first, 4) == by_node(second, 4)
    assert [first.slot(r, w) for r in range(32) for w in range(2)] != [
        second.slot(r, w) for r in range(32) for w in range(2)
    ]
    spread = max(second.samples_per_rank) / min(second.samples_per_rank)
    assert spread < 1.1, second.samples_per_rank  # 30 shards a rank, dealt by samples


def test_without_canonical_nodes_a_node_reads_mostly_other_shards_the_next_epoch() -> None:
    """What --canonical-nodes saves: without it a node's second epoch is nearly all new shards
    (each shard stays with probability 1/8), so a node cache would miss them."""
    first, second = by_node(plan(32, 0, None), 4), by_node(plan(32, 1, None), 4)
    kept = sum(len(a & b) for a, b in zip(first, second))
    assert kept < 0.25 * len(SHARDS), kept


def test_when_the_nodes_change_whole_canonical_nodes_move() -> None:
    home = canonical(SHARDS, 8, seed=5)
    for count in (8, 4, 2, 6, 3):  # 32 ranks on 8 nodes, then fewer, some not a divisor of 8
        p = plan(4 * count, 0, Nodes(canonical=8, ranks_per_node=4))
        once(p)
        for node, names in enumerate(by_node(p, 4)):
            assert {home[n] for n in names} == {c for c in range(8) if c % count == node}


def test_canonical_nodes_hold_even_samples_and_ignore_the_epoch_and_world() -> None:
    home = canonical(SHARDS, 8, seed=5)
    totals = Counter()
    for s in SHARDS:
        totals[home[s.name]] += s.num_samples
    assert max(totals.values()) - min(totals.values()) <= 80  # one shard's worth at most
    assert canonical(SHARDS, 8, seed=5) == home and canonical(SHARDS, 8, seed=6) != home


def test_a_resumed_epoch_keeps_the_shards_left_on_their_nodes() -> None:
    from raywds.plan.epoch import Done

    nodes = Nodes(canonical=8, ranks_per_node=4)
    home = canonical(SHARDS, 8, seed=5)
    per_shard = tuple(s.num_samples if i % 3 == 0 else i % 7 for i, s in enumerate(SHARDS))
    done = Done(samples=sum(min(d, s.num_samples) for d, s in zip(per_shard, SHARDS)), per_shard=per_shard)
    p = Split().plan(SHARDS, num_ranks=16, num_workers=2, batch_size=8, seed=5, epoch=2, done=done, nodes=nodes)
    left = {s.name: s.num_samples - d for s, d in zip(SHARDS, per_shard) if d < s.num_samples}
    assert {s.name: s.num_samples for slot in p.slots for s in slot} == left
    for node, names in enumerate(by_node(p, 4)):
        assert {home[n] for n in names} <= {node, node + 4}


@pytest.mark.parametrize("ranks", [1, 8, 32])
def test_without_the_flag_the_plan_is_the_deal_it_always_was(ranks: int) -> None:
    """The plan before --canonical-nodes: the shards shuffled by (seed, epoch), dealt to the
    ranks, then to their workers. Old checkpoints resume into the same plans."""
    order = list(SHARDS)
    seeds.rng(seeds.SHARD_ORDER, 5, 3).shuffle(order)
    before = [slot for rank in deal(order, ranks) for slot in deal(rank, 2)]
    for nodes in (None, Nodes(canonical=0, ranks_per_node=4)):
        p = Split().plan(SHARDS, num_ranks=ranks, num_workers=2, batch_size=8, seed=5, epoch=3, nodes=nodes)
        assert p.slots == before


def test_a_run_plans_by_its_nodes_from_the_flag_and_the_world(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--canonical-nodes reaches the plan, with the ranks per node torchrun gives (LOCAL_WORLD_SIZE)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert World.from_env().ranks_per_node == 2
    manifest = read_manifest(str(shards))
    cfg = TrainConfig(data=str(shards), mode="split", canonical_nodes=2, loader_workers=1, seed=5)
    home = canonical(manifest.shards("train"), 2, seed=5)
    for epoch in (0, 1):
        p = epoch_plan(manifest, cfg, 4, epoch=epoch, ranks_per_node=2)
        assert [{home[n] for n in names} for names in by_node(p, 2)] == [{0}, {1}]
    assert epoch_plan(manifest, cfg, 4, epoch=1).slots != p.slots  # each rank its own node: another deal
