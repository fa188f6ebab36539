"""`raywds plan`'s report and verdict at their edges: the shards of --data read in process, the
ranks shown by default and for an odd limit, and the batch size suggested for a share under one."""

from __future__ import annotations

from pathlib import Path

from raywds.data.manifest import ShardInfo, read_manifest
from raywds.plan.checks import check
from raywds.plan.render import plan_shards, render, shown_ranks
from raywds.plan.resample import Resample


def test_the_shards_of_data_are_its_training_shards(shards: Path) -> None:
    made = plan_shards(str(shards), None, None, None)
    assert made == list(read_manifest(str(shards)).shards("train")) and len(made) == 8


def test_a_report_shows_sixteen_ranks_by_default() -> None:
    plan = Resample().plan([ShardInfo("s.tar", 170, 0, "")], num_ranks=17, num_workers=1, batch_size=10)
    rows = render(plan, [], gpus_per_node=1).splitlines()[2:19]
    assert [row.split()[0] for row in rows] == [*map(str, range(8)), "...", *map(str, range(9, 17))]


def test_an_odd_limit_shows_every_rank_it_covers() -> None:
    assert shown_ranks(5, 5) == [0, 1, 2, 3, 4] and shown_ranks(6, 5) == [0, 1, 4, 5]


def test_a_share_under_one_sample_suggests_a_batch_of_one() -> None:
    plan = Resample().plan([ShardInfo("s.tar", 1, 0, "")], num_ranks=2, num_workers=1, batch_size=4)
    warned = [f.text for f in check(plan, num_shards=1) if f.level == "warn"]
    assert len(warned) == 1 and warned[0].endswith("; use --batch-size 1 or less")
