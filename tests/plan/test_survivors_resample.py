"""Resample mode at its edges: the read-ahead warning at two workers and at exactly 3x, the
coverage of a one-sample split, a resume after one sample, and a plan that deals no slots."""

from __future__ import annotations

import pytest

from raywds.data.manifest import ShardInfo
from raywds.errors import DataError
from raywds.plan.checks import check
from raywds.plan.epoch import Done
from raywds.plan.resample import Resample


def shards_of(sizes: list[int]) -> list[ShardInfo]:
    return [ShardInfo(f"s-{i:04d}.tar", n, 0, "") for i, n in enumerate(sizes)]


def read_ahead(num_workers: int, batches: int) -> list[str]:
    plan = Resample().plan(shards_of([100]), num_ranks=1, num_workers=num_workers, batch_size=100 // batches)
    assert plan.max_batches == batches
    return [f.text.split(":")[0] for f in check(plan, num_shards=1) if f.level == "warn"]


def test_two_workers_decoding_five_times_what_the_epoch_takes_are_warned_of() -> None:
    assert read_ahead(2, 1) == ["the loader workers decode about 5x what the epoch takes"]


def test_decoding_exactly_three_times_what_the_epoch_takes_is_warned_of_and_less_is_not() -> None:
    assert read_ahead(2, 2) == ["the loader workers decode about 3x what the epoch takes"]  # (2 + 2 x 2) / 2
    assert read_ahead(2, 4) == []  # (4 + 2 x 2) / 4 = 2x


def test_one_draw_over_a_single_sample_reaches_about_63_percent_of_it() -> None:
    plan = Resample().plan(shards_of([1]), num_ranks=1, num_workers=1, batch_size=1)
    assert [f.text[:60] for f in check(plan, num_shards=1)] == [
        "every rank takes 1 full batches; 1 draws over 1 samples reac"
    ]
    assert "reach about 63% of them" in check(plan, num_shards=1)[0].text


def test_an_epoch_resumed_after_one_sample_is_resumed() -> None:
    plan = Resample().plan(shards_of([10]), num_ranks=1, num_workers=1, batch_size=2, done=Done(1))
    assert plan.resumed and plan.batches_per_rank == [5]


def test_a_resample_plan_deals_no_shards_to_slots() -> None:
    plan = Resample().plan(shards_of([10, 10]), num_ranks=2, num_workers=3, batch_size=2)
    assert len(plan.slots) == 0 and list(plan.slots) == [] and plan.slots.idle() == 0


def test_a_rank_whose_draws_run_out_is_told_why() -> None:
    plan = Resample().plan(shards_of([12]), num_ranks=2, num_workers=1, batch_size=2)
    with pytest.raises(
        DataError,
        match=r"^rank 0: its loader workers' shard draws ran out after 1 of 3 batches \(more samples were skipped "
        r"than the draws leave room for\)$",
    ):
        list(Resample().epoch_batches(iter("a"), plan, 0))
