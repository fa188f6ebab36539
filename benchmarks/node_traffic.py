"""What the shard servers send in a split run's second epoch, with and without --canonical-nodes,
when each node keeps what it read in a local cache (--cache-dir): a simulation with raywds's
own planner on a synthetic LAION-400M-sized manifest (400,000 shards of ~1,000 samples,
tests/plan/test_scale.py's), 8 ranks a node, 8 loader workers a rank.

For 64 and 512 nodes: the share of the dataset (and TB, at 150 MB a shard) that epoch 2 must
fetch from the servers because a node did not read that shard in epoch 1; then the same when
epoch 2 runs on half the nodes (the first half, whose caches survive). Without the flag a node
reads a fresh 1/N of the shards each epoch; with it (as many canonical nodes as nodes) the same
ones. Also the seconds one plan takes (one core).

    .venv/bin/python benchmarks/node_traffic.py            # the table in docs/performance.md
    .venv/bin/python benchmarks/node_traffic.py --quick    # 20,000 shards
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plan"))  # the tests' synthetic manifests

from test_scale import synthetic

from raywds.data.manifest import ShardInfo
from raywds.plan.epoch import Nodes
from raywds.plan.split import Split

RANKS_PER_NODE, WORKERS = 8, 8


def nodes_of(shards: list[ShardInfo], nodes: int, epoch: int, canonical: int) -> tuple[list[set[str]], float]:
    """The shard names each node reads in `epoch`, and the plan's seconds."""
    start = time.perf_counter()
    plan = Split().plan(
        shards,
        num_ranks=nodes * RANKS_PER_NODE,
        num_workers=WORKERS,
        batch_size=256,
        seed=0,
        epoch=epoch,
        nodes=Nodes(canonical, RANKS_PER_NODE) if canonical else None,
    )
    took = time.perf_counter() - start
    per_node: list[set[str]] = [set() for _ in range(nodes)]
    for rank in range(plan.num_ranks):
        for worker in range(WORKERS):
            per_node[rank // RANKS_PER_NODE].update(s.name for s in plan.slot(rank, worker))
    return per_node, took


def fetched(before: list[set[str]], after: list[set[str]], size: dict[str, int]) -> int:
    """Bytes the servers send when node k reads `after[k]` holding `before[k]` (nothing for a new node)."""
    return sum(size[n] for k, names in enumerate(after) for n in names - (before[k] if k < len(before) else set()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20,000 shards")
    args = parser.parse_args()
    shards = list(synthetic(20_000 if args.quick else 400_000).shards("train"))
    size = {s.name: s.num_bytes for s in shards}
    total = sum(size.values())
    print(f"{len(shards):,} shards, {total / 1e12:.1f} TB; {RANKS_PER_NODE} ranks a node, {WORKERS} workers a rank")
    print()
    print("| nodes | deal | epoch 2, same nodes | epoch 2, half the nodes | one plan |")
    print("| --- | --- | --- | --- | --- |")
    for nodes in (64, 512):
        for canonical in (0, nodes):
            first, took = nodes_of(shards, nodes, 0, canonical)
            same = fetched(first, nodes_of(shards, nodes, 1, canonical)[0], size)
            half = fetched(first, nodes_of(shards, nodes // 2, 1, canonical)[0], size)
            deal = f"--canonical-nodes {canonical}" if canonical else "every epoch anew"
            print(
                f"| {nodes} | {deal} | {same / total:.1%} ({same / 1e12:.1f} TB) "
                f"| {half / total:.1%} ({half / 1e12:.1f} TB) | {took:.1f} s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
