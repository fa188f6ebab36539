"""The planner over many (nodes x workers x shards x samples x batch) settings, checked by
replaying every rank through the loader's own stages with synthetic samples."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from raywds.data.manifest import ShardInfo
from raywds.loader.mixing import replay, report, shuffled_labels, sorted_labels
from raywds.plan.checks import check, refusals, verdict
from raywds.plan.epoch import split_batches
from raywds.plan.modes import Resample, Split
from raywds.plan.position import Position
from raywds.plan.render import render


def shards_of(sizes: list[int]) -> list[ShardInfo]:
    return [ShardInfo(f"s-{i:04d}.tar", n, 0, "") for i, n in enumerate(sizes)]


def settings(count: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        nodes, gpus, workers = rng.randint(1, 4), rng.choice([1, 2, 3, 8]), rng.randint(1, 4)
        ranks = nodes * gpus
        num_shards = rng.randint(ranks * workers, ranks * workers * 3 + 5)
        shape = rng.choice(["equal", "short-last", "random"])
        per = rng.randint(1, 40)
        sizes = [per] * num_shards
        if shape == "short-last":
            sizes[-1] = rng.randint(1, per)
        elif shape == "random":
            sizes = [rng.randint(1, 2 * per) for _ in range(num_shards)]
        yield ranks, workers, rng.randint(1, 48), sizes, rng.randint(0, 5)


@pytest.mark.parametrize("chunk", range(4))
def test_split_plans_deliver_every_sample_exactly_once(chunk: int) -> None:
    for ranks, workers, batch, sizes, epoch in settings(50, seed=chunk):
        shards = shards_of(sizes)
        plan = Split().plan(shards, num_ranks=ranks, num_workers=workers, batch_size=batch, seed=1, epoch=epoch)
        assert refusals(check(plan, num_shards=len(shards))) == []
        ids: Counter = Counter()
        for rank in range(ranks):
            batches = replay(
                plan,
                shards,
                sorted_labels(sum(sizes), 10),
                seed=1,
                epoch=epoch,
                worker_buffer=7,
                cross_buffer=0,
                num_batches=None,
                rank=rank,
            )
            what = f"ranks={ranks} workers={workers} batch={batch} sizes={sizes} rank={rank}"
            assert len(batches) == plan.batches_per_rank[rank], what
            assert sum(len(b.keys) for b in batches) == plan.samples_per_rank[rank], what
            assert all(len(b.keys) == batch for b in batches[:-1]) or len(batches[-1].keys) == batch + 1, what
            assert batch == 1 or len(batches) <= 1 or len(batches[-1].keys) > 1, f"a single-sample last batch: {what}"
            ids.update(int(i) for b in batches for i in b.ids)
        assert ids == Counter(range(sum(sizes))), "every sample exactly once"
        loads = plan.samples_per_rank
        assert max(loads) - min(loads) <= max(sizes), "ranks are dealt by sample count, not shard count"


def test_resample_plans_give_every_rank_equal_full_batches() -> None:
    for ranks, workers, batch, sizes, epoch in settings(40, seed=9):
        shards = shards_of(sizes)
        plan = Resample().plan(shards, num_ranks=ranks, num_workers=workers, batch_size=batch)
        expected = math.ceil(sum(sizes) / (ranks * batch))
        assert plan.batches_per_rank == [expected] * ranks
        for rank in range(min(ranks, 3)):
            batches = replay(
                plan,
                shards,
                sorted_labels(sum(sizes), 10),
                seed=2,
                epoch=epoch,
                worker_buffer=5,
                cross_buffer=batch,
                num_batches=None,
                rank=rank,
            )
            assert [len(b.keys) for b in batches] == [batch] * expected


def test_a_resumed_split_plan_deals_only_what_is_left() -> None:
    shards = shards_of([10, 10, 10, 5])
    consumed = np.zeros(35, dtype=bool)
    consumed[[*range(0, 10), *range(10, 13), *range(30, 35)]] = True  # 10, 3, 0 and 5 samples of the four shards
    done = Position.of_flags(consumed, shards, mode=Split(), epoch=0, step=2, samples_done=18, dataset="")
    plan = Split().plan(shards, num_ranks=2, num_workers=2, batch_size=4, seed=0, epoch=0, done=done.done())
    assert sum(plan.samples_per_rank) == 17 and plan.num_samples == 35
    assert sorted(s.name for slot in plan.slots for s in slot) == ["s-0001.tar", "s-0002.tar"]
    assert refusals(check(plan, num_shards=4)) == [], "idle slots are fine at the end of a resumed epoch"
    on_three = Split().plan(shards, num_ranks=3, num_workers=1, batch_size=4, seed=0, epoch=0, done=done.done())
    assert sorted(on_three.samples_per_rank) == [0, 7, 10]
    assert "1 of 3 ranks have no samples left in this epoch (2 shards are)" in [
        f.text.split(";")[0] for f in check(on_three, num_shards=4) if f.level == "warn"
    ]


def test_verdicts_say_what_would_hang_and_the_fix() -> None:
    few = shards_of([16] * 8)
    plan = Split().plan(few, num_ranks=3, num_workers=4, batch_size=8, seed=0, epoch=0)
    findings = check(plan, num_shards=8)
    assert verdict(findings).startswith(
        "REFUSED: split mode needs at least one shard per (rank, loader worker): 8 shards < 3 ranks x 4 workers"
    )
    assert "reconvert with a smaller --maxcount (about 2, for 20 shards or more per rank" in refusals(findings)[0]
    assert refusals(findings)[0].endswith("or use fewer --loader-workers")
    one_worker = Split().plan(shards_of([16] * 8), num_ranks=12, num_workers=1, batch_size=8, seed=0, epoch=0)
    assert not refusals(check(one_worker, num_shards=8))[0].endswith("--loader-workers"), "nothing fewer than one"

    uneven = Split().plan(shards_of([40, 8, 8]), num_ranks=2, num_workers=1, batch_size=8, seed=0, epoch=0)
    texts = [f.text for f in check(uneven, num_shards=3)]
    assert uneven.batches_per_rank == [5, 2] or uneven.batches_per_rank == [2, 5]
    assert any("a DDP loop without Join would hang at step 3" in t for t in texts)
    assert any(t.startswith("ranks are uneven: 16..40 samples") for t in texts)
    assert verdict(check(uneven, num_shards=3)).startswith("OK, but ranks are uneven")

    sampled = Resample().plan(shards_of([1000]), num_ranks=4, num_workers=2, batch_size=25)
    assert any("reach about 63% of them" in f.text for f in check(sampled, num_shards=10))
    assert not [f for f in check(sampled, num_shards=10) if f.level == "warn"]
    wide = Resample().plan(shards_of([1000]), num_ranks=4, num_workers=16, batch_size=25)
    assert [f.text.split(":")[0] for f in check(wide, num_shards=10) if f.level == "warn"] == [
        "the loader workers decode about 4x what the epoch takes"
    ], "16 workers x 2 batches ahead, against 10 batches a rank takes"


def test_a_batch_larger_than_a_ranks_share_is_warned_in_both_modes() -> None:
    big = Resample().plan(shards_of([120]), num_ranks=2, num_workers=1, batch_size=100)
    warned = [f.text for f in check(big, num_shards=8) if f.level == "warn"]
    assert warned == [
        "batch 100 per rank is more than a rank's share of the data (120 samples / 2 ranks = 60): every epoch is "
        "1 step(s) per rank, so samples repeat within each batch; use --batch-size 60 or less"
    ]
    split = Split().plan(shards_of([16] * 8), num_ranks=2, num_workers=1, batch_size=100, seed=0, epoch=0)
    assert any(
        f.level == "warn" and f.text.endswith("1 step(s) per rank of a partial batch; use --batch-size 64 or less")
        for f in check(split, num_shards=8)
    )
    fits = Resample().plan(shards_of([120]), num_ranks=2, num_workers=1, batch_size=60)
    assert not [f for f in check(fits, num_shards=8) if f.level == "warn"]


def test_single_sample_tails_are_folded() -> None:
    assert split_batches(17, 8) == 2 and split_batches(16, 8) == 2 and split_batches(18, 8) == 3
    assert split_batches(1, 8) == 1 and split_batches(9, 8) == 1


def test_render_shows_ranks_workers_and_verdict() -> None:
    shards = shards_of([100] * 12 + [37])
    plan = Split().plan(shards, num_ranks=4, num_workers=2, batch_size=32, seed=0, epoch=0)
    text = render(plan, check(plan, num_shards=13), gpus_per_node=2)
    lines = text.splitlines()
    assert lines[0] == "split mode: 4 ranks x 2 loader workers, batch 32 per rank, 1237 samples"
    rows = [line.split() for line in lines[2:6]]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3] and [int(r[1]) for r in rows] == [0, 0, 1, 1]
    assert sum(int(r[3]) for r in rows) == 1237
    assert any(line.startswith("  rank 0 worker 1: s-") for line in lines)
    assert lines[-1].startswith("verdict: OK")


def test_shuffle_report_tells_sorted_shards_from_shuffled_ones() -> None:
    shards = shards_of([100] * 200)
    plan = Split().plan(shards, num_ranks=2, num_workers=4, batch_size=64, seed=0, epoch=0)

    def classes(labels, cross: int) -> float:
        batches = replay(plan, shards, labels, seed=0, epoch=0, worker_buffer=200, cross_buffer=cross, num_batches=30)
        return sum(len(set(b.labels.tolist())) for b in batches) / len(batches)

    ideal = 100 * (1 - (1 - 1 / 100) ** 64)
    assert classes(shuffled_labels(20000, 100, 0), 0) > 0.9 * ideal
    assert classes(sorted_labels(20000, 100), 0) < 0.2 * ideal, "class-sorted shards stay sorted inside a worker"
    assert classes(sorted_labels(20000, 100), 256) > 2 * classes(sorted_labels(20000, 100), 0), (
        "the cross-worker buffer mixes workers"
    )
    text = report(
        plan, shards, data=None, num_classes=100, seed=0, epoch=0, worker_buffer=200, cross_buffer=0, num_batches=10
    )
    assert "class-sorted shards (worst case)" in text and f"{ideal:.1f}" in text
    assert torch.is_tensor(
        replay(
            plan, shards, sorted_labels(20000, 100), seed=0, epoch=0, worker_buffer=1, cross_buffer=0, num_batches=1
        )[0].ids
    )


def test_the_plan_modules_import_no_circle_not_even_for_annotations() -> None:
    """A mode plans from `Done` (what it needs of a resume), not from `Position`, which imports the
    modes: no two modules of raywds.plan reach each other, type-checking imports included."""
    import itertools

    import grimp

    graph = grimp.build_graph("raywds", exclude_type_checking_imports=False)
    modules = sorted(m for m in graph.modules if m.startswith("raywds.plan."))
    circles = [
        (a, b) for a, b in itertools.combinations(modules, 2) if graph.chain_exists(a, b) and graph.chain_exists(b, a)
    ]
    assert circles == []
