"""`raywds plan`'s report: one row per rank, the shards each worker opens, then the verdict.

raywds plan --num-shards 1282 --samples-per-shard 1000 --nodes 64 --gpus-per-node 8 --workers 6
"""

from __future__ import annotations

from raywds.data.dataset import manifest_for
from raywds.data.manifest import ShardInfo
from raywds.errors import ConfigError
from raywds.plan.checks import verdict
from raywds.plan.epoch import EpochPlan, Finding


def plan_shards(
    data: str | None, num_shards: int | None, samples_per_shard: int | None, last_shard_samples: int | None
) -> list[ShardInfo]:
    """The training shards of --data, or made up: `num_shards` of `samples_per_shard` (the last
    of `last_shard_samples`, when given)."""
    if data:
        return list(manifest_for(data).shards("train"))
    if not (num_shards and samples_per_shard):
        raise ConfigError("plan needs --data SHARDS, or --num-shards N --samples-per-shard K")
    sizes = [samples_per_shard] * num_shards
    if last_shard_samples is not None:
        sizes[-1] = last_shard_samples
    return [ShardInfo(f"shard-{i:06d}.tar", n, 0, "") for i, n in enumerate(sizes)]


def shown_ranks(num_ranks: int, max_shown: int) -> list[int]:
    """Every rank, or the first and last `max_shown / 2` of many."""
    if num_ranks <= max_shown:
        return list(range(num_ranks))
    return [*range(max_shown // 2), *range(num_ranks - max_shown // 2, num_ranks)]


def render(plan: EpochPlan, findings: list[Finding], *, gpus_per_node: int, max_ranks_shown: int = 16) -> str:
    lines = [
        f"{plan.mode.name} mode: {plan.num_ranks} ranks x {plan.num_workers} loader workers, "
        f"batch {plan.batch_size} per rank, {plan.num_samples} samples",
        f"{'rank':>5} {'node':>5} {'shards':>7} {'samples':>8} {'batches':>8} {'last batch':>11}",
    ]
    shown = shown_ranks(plan.num_ranks, max_ranks_shown)
    for i, rank in enumerate(shown):
        if i and rank != shown[i - 1] + 1:
            lines.append(f"{'...':>5}")
        num_shards, last = plan.mode.rank_columns(plan, rank)
        samples, batches = plan.samples_per_rank[rank], plan.batches_per_rank[rank]
        lines.append(f"{rank:>5} {rank // gpus_per_node:>5} {num_shards:>7} {samples:>8} {batches:>8} {last:>11}")
    lines += plan.mode.worker_lines(plan, shown)
    lines += [f"{f.level}: {f.text}" for f in findings]
    lines.append("verdict: " + verdict(findings))
    return "\n".join(lines)
