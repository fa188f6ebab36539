"""What the planner says, word for word, in process: `raywds plan`'s report (each rank's row, the
shards each worker opens, every finding and the verdict) for plans that set off each finding; the
refusal that stops training before a step; what a resume checks of the data (a shard gone, grown,
changed or reordered, an append); the position's own checks and what it hands a plan and a loader;
the seeds every random stream is built from; and the arithmetic of a resumed resample epoch."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
from support.runs import small_config

from raywds.data.manifest import Manifest, ShardInfo
from raywds.errors import ConfigError, DataError
from raywds.plan import position, seeds
from raywds.plan.checks import check, check_plan, refusals, verdict
from raywds.plan.epoch import Done, Finding, Nodes, remaining
from raywds.plan.modes import epoch_plan, loader_slots, nodes_of, parse
from raywds.plan.position import Position, already_done, check_same_shards, done_in, grown, per_shard, shard_entries
from raywds.plan.render import plan_shards, render, shown_ranks
from raywds.plan.resample import Resample
from raywds.plan.split import Split, canonical, suggested_maxcount


def shards_of(sizes: list[int]) -> list[ShardInfo]:
    return [ShardInfo(f"s-{i:04d}.tar", n, 0, "") for i, n in enumerate(sizes)]


def reported(mode: Split | Resample, sizes: list[int], **plan: int) -> str:
    shown = {k: plan.pop(k) for k in ("gpus_per_node", "max_ranks_shown") if k in plan}
    shards = shards_of(sizes)
    made = mode.plan(shards, seed=1, epoch=0, **plan)  # type: ignore[arg-type]
    return render(made, check(made, num_shards=len(shards)), **{"gpus_per_node": 1, **shown})


def test_uneven_split_ranks_a_spare_sample_and_an_idle_worker_are_each_said() -> None:
    assert reported(Split(), [100, 5, 5, 5, 9, 9], num_ranks=2, num_workers=2, batch_size=8) == "\n".join(
        [
            "split mode: 2 ranks x 2 loader workers, batch 8 per rank, 133 samples",
            " rank  node  shards  samples  batches  last batch",
            "    0     0       1      100       13           4",
            "    1     1       5       33        4           9",
            "shards each worker opens:",
            "  rank 0 worker 0: s-0000.tar",
            "  rank 0 worker 1: (none)",
            "  rank 1 worker 0: s-{0002..0004}.tar",
            "  rank 1 worker 1: s-0001.tar s-0005.tar",
            "warn: 1 loader workers get no shard (a few shards are much larger than the rest); smaller shards "
            "(--maxcount) keep every worker busy",
            "note: ranks take 4..13 batches: a DDP loop without Join would hang at step 5 (rank 0 waits for ranks "
            "that are done); raywds wraps the epoch in Join",
            "warn: ranks are uneven: 33..100 samples, so the least loaded rank idles 67% of each epoch; more, smaller "
            "shards (--maxcount) even it out",
            "note: 1 rank(s) end with one spare sample; it joins their previous batch (BatchNorm cannot train on one)",
            "note: every sample once: 133 samples this epoch",
            "verdict: OK, but 1 loader workers get no shard (a few shards are much larger than the rest); smaller "
            "shards (--maxcount) keep every worker busy",
        ]
    )


REFUSAL = (
    "split mode needs at least one shard per (rank, loader worker): 3 shards < 2 ranks x 2 workers, so 1 workers "
    "would read nothing; reconvert with a smaller --maxcount (about 1, for 20 shards or more per rank and one or "
    "more per worker) or use fewer --loader-workers"
)


def test_fewer_shards_than_slots_is_refused_with_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    assert reported(Split(), [10, 10, 10], num_ranks=2, num_workers=2, batch_size=32) == "\n".join(
        [
            "split mode: 2 ranks x 2 loader workers, batch 32 per rank, 30 samples",
            " rank  node  shards  samples  batches  last batch",
            "    0     0       2       20        1          20",
            "    1     1       1       10        1          10",
            "shards each worker opens:",
            "  rank 0 worker 0: s-0002.tar",
            "  rank 0 worker 1: s-0001.tar",
            "  rank 1 worker 0: s-0000.tar",
            "  rank 1 worker 1: (none)",
            "warn: batch 32 per rank is more than a rank's share of the data (30 samples / 2 ranks = 15): every "
            "epoch is 1 step(s) per rank of a partial batch; use --batch-size 15 or less",
            f"refuse: {REFUSAL}",
            "warn: ranks are uneven: 10..20 samples, so the least loaded rank idles 50% of each epoch; more, smaller "
            "shards (--maxcount) even it out",
            "note: every sample once: 30 samples this epoch",
            f"verdict: REFUSED: {REFUSAL}",
        ]
    )
    manifest = Manifest(base="/x", classes=["a"], splits={"train": shards_of([10, 10, 10])})
    plan = Split().plan(manifest.shards("train"), num_ranks=2, num_workers=2, batch_size=32, seed=1)
    with pytest.raises(ConfigError) as refused:
        check_plan(plan, manifest)
    assert str(refused.value) == REFUSAL
    one = Split().plan(manifest.shards("train"), num_ranks=2, num_workers=1, batch_size=32, seed=1)
    with caplog.at_level(logging.INFO, logger="raywds"):
        check_plan(one, manifest)  # warnings are logged, notes are not
    assert [r.getMessage()[:30] for r in caplog.records] == [
        "batch 32 per rank is more than",
        "ranks are uneven: 10..20 sampl",
    ]
    assert all(r.levelname == "WARNING" for r in caplog.records)


def test_a_resample_report_elides_the_middle_ranks_and_warns_of_read_ahead() -> None:
    text = reported(
        Resample(), [10] * 40, num_ranks=20, num_workers=4, batch_size=10, gpus_per_node=8, max_ranks_shown=4
    )
    assert text == "\n".join(
        [
            "resample mode: 20 ranks x 4 loader workers, batch 10 per rank, 400 samples",
            " rank  node  shards  samples  batches  last batch",
            "    0     0  random       20        2          10",
            "    1     0  random       20        2          10",
            "  ...",
            "   18     2  random       20        2          10",
            "   19     2  random       20        2          10",
            "shards each worker opens: drawn at random with replacement, seeded by (seed, epoch, rank, worker), "
            "about 5 samples per worker",
            "warn: the loader workers decode about 5x what the epoch takes: each of a rank's 4 workers decodes 2 "
            "batches ahead, and a rank takes 2 per epoch; use fewer --loader-workers, a smaller --batch-size, or "
            "--mode split",
            "note: every rank takes 2 full batches; 400 draws over 400 samples reach about 63% of them (samples "
            "repeat or are missed; --mode split gives exact epochs)",
            "verdict: OK, but the loader workers decode about 5x what the epoch takes: each of a rank's 4 workers "
            "decodes 2 batches ahead, and a rank takes 2 per epoch; use fewer --loader-workers, a smaller "
            "--batch-size, or --mode split",
        ]
    )
    few = reported(Resample(), [10] * 40, num_ranks=20, num_workers=4, batch_size=4)
    assert "decode about" not in few and "every rank takes 5 full batches; 400 draws" in few  # 2.6x: no warning
    one = reported(Resample(), [10] * 4, num_ranks=1, num_workers=1, batch_size=40)
    assert "decode about" not in one and one.endswith("verdict: OK")
    none = Resample().plan(shards_of([10]), num_ranks=1, num_workers=2, batch_size=4, batches_per_epoch=0)
    assert Resample().rank_columns(none, 0) == ("random", 0) and verdict(check(none, num_shards=1)) == "OK"


def test_a_split_report_names_at_most_six_runs_of_shards_a_worker() -> None:
    text = reported(Split(), [10] * 40, num_ranks=2, num_workers=1, batch_size=4, gpus_per_node=8)
    lines = text.splitlines()
    assert lines[2:4] == [
        "    0     0      20      200       50           4",
        "    1     0      20      200       50           4",
    ]
    opens = [line for line in lines if line.startswith("  rank ")]
    assert len(opens) == 2 and all(line.endswith(" ... (20 shards)") for line in opens)
    assert all(len(line.split(": ", 1)[1].removesuffix(" ... (20 shards)").split()) == 6 for line in opens)
    assert lines[-2:] == ["note: every sample once: 400 samples this epoch", "verdict: OK"]
    assert shown_ranks(5, 16) == [0, 1, 2, 3, 4] and shown_ranks(16, 16) == list(range(16))
    assert shown_ranks(17, 16) == [*range(8), *range(9, 17)] and shown_ranks(9, 5) == [0, 1, 7, 8]


def test_a_resumed_plan_with_ranks_left_without_samples_says_they_wait() -> None:
    shards = shards_of([10, 10, 10, 10])
    plan = Split().plan(shards, num_ranks=3, num_workers=1, batch_size=4, seed=1, done=Done(30, (10, 10, 10, 0)))
    assert plan.resumed and plan.samples_per_rank.count(0) == 2
    assert [f for f in check(plan, num_shards=4) if f.level != "note"] == [
        Finding(
            "warn",
            "2 of 3 ranks have no samples left in this epoch (1 shards are); they wait in Join while the others "
            "finish it, and all start the next epoch together",
        )
    ]
    assert refusals(check(plan, num_shards=2)) == [], "a resumed epoch may have fewer shards left than slots"
    nodes = Split().plan(shards, num_ranks=4, num_workers=1, batch_size=4, seed=1, nodes=Nodes(1, 2))
    assert nodes.samples_per_rank.count(0) == 2 and [f.text[:40] for f in check(nodes, num_shards=4)][:1] == [
        "2 of 4 ranks get no shards in this epoch"
    ]


def test_the_numbers_behind_the_report() -> None:
    plan = Split().plan(shards_of([10] * 8), num_ranks=2, num_workers=3, batch_size=4, seed=1)
    assert suggested_maxcount(plan) == 2  # 80 samples / (20 shards x 2 ranks)
    plan = Split().plan(shards_of([1000] * 8), num_ranks=2, num_workers=30, batch_size=4, seed=1)
    assert suggested_maxcount(plan) == 133  # 8000 / (2 ranks x 30 workers): one shard a worker
    assert Split().rank_columns(plan, 0) == ("4", 4000 - 999 * 4)
    empty = Split().plan(shards_of([5]), num_ranks=2, num_workers=1, batch_size=4, seed=1)
    assert Split().rank_columns(empty, 1) == ("0", 0)
    with pytest.raises(ConfigError, match=r"^rank 2, worker 0 is not among the 2 x 1 slots dealt$"):
        Split().shards_for(empty, [], rank=2, worker=0, seed=1, epoch=0)
    with pytest.raises(ConfigError, match=r"^rank 0, worker 1 is not among the 2 x 1 slots dealt$"):
        Split().shards_for(empty, [], rank=0, worker=1, seed=1, epoch=0)
    assert list(Split().shards_for(empty, [], rank=1, worker=0, seed=1, epoch=0)) == []
    assert verdict([Finding("note", "n"), Finding("warn", "w1"), Finding("warn", "w2")]) == "OK, but w1"
    assert verdict([Finding("warn", "w"), Finding("refuse", "r1"), Finding("refuse", "r2")]) == "REFUSED: r1"
    assert verdict([Finding("note", "n")]) == "OK"


def test_canonical_nodes_are_the_seeds_alone() -> None:
    shards = shards_of([5, 6, 7, 8, 9, 10] * 3)
    home = canonical(shards, 3, seed=1)
    assert set(home) == {s.name for s in shards} and sorted(set(home.values())) == [0, 1, 2]
    assert canonical(shards, 3, seed=1) == home and canonical(shards, 3, seed=2) != home
    by_node = {g: sum(s.num_samples for s in shards if home[s.name] == g) for g in range(3)}
    assert max(by_node.values()) - min(by_node.values()) <= 10, by_node


def test_the_mode_named_in_config_text_and_its_plan() -> None:
    with pytest.raises(ConfigError, match=r"^mode='exact' is not one of resample, split$"):
        parse("exact")
    assert loader_slots(0) == 1 and loader_slots(3) == 3
    assert nodes_of(0, 8) is None and nodes_of(4, 8) == Nodes(4, 8)
    manifest = Manifest(base="/x", classes=["a"], splits={"train": shards_of([10] * 8)})
    cfg = small_config("/x", mode="resample", batch_size=4, loader_workers=2, batches_per_epoch=3, seed=5)
    plan = epoch_plan(manifest, cfg, 2, epoch=1, done=Done(8))
    assert (plan.num_ranks, plan.num_workers, plan.batch_size, plan.batches_per_rank) == (2, 2, 4, [2, 2])
    cfg = dataclasses.replace(cfg, mode="split", batches_per_epoch=None, canonical_nodes=2, loader_workers=0)
    plan = epoch_plan(manifest, cfg, 2, epoch=1, ranks_per_node=1)
    assert (
        plan.num_workers == 1
        and plan.slots.by_rank
        == Split()
        .plan(manifest.shards("train"), num_ranks=2, num_workers=1, batch_size=4, seed=5, epoch=1, nodes=Nodes(2, 1))
        .slots.by_rank
    )


def test_a_resumed_resample_epoch_takes_what_is_left_of_its_batches() -> None:
    shards = shards_of([3, 4, 5])  # 12 samples, 2 ranks x batches of 2
    plan = Resample().plan(shards, num_ranks=2, num_workers=1, batch_size=2)
    assert (plan.batches_per_rank, plan.samples_per_rank, plan.resumed) == ([3, 3], [6, 6], False)
    assert Resample().plan(shards, num_ranks=2, num_workers=1, batch_size=2, done=Done(5)).batches_per_rank == [2, 2]
    assert Resample().plan(shards, num_ranks=2, num_workers=1, batch_size=2, done=Done(12)).batches_per_rank == [0, 0]
    assert Resample().plan(shards, num_ranks=2, num_workers=1, batch_size=2, done=Done(99)).batches_per_rank == [0, 0]
    paced = Resample().plan(shards, num_ranks=2, num_workers=1, batch_size=2, batches_per_epoch=5, done=Done(5))
    assert paced.batches_per_rank == [4, 4] and paced.resumed and paced.num_samples == 12
    drawn = Resample().plan(shards, num_ranks=2, num_workers=1, batch_size=2, batches_per_epoch=1, done=Done(8))
    assert drawn.batches_per_rank == [0, 0]

    def draws(**reseed: int) -> list[str]:
        stream = Resample().shards_for(plan, shards, rank=1, worker=0, seed=3, epoch=2, **reseed)
        return [next(stream).name for _ in range(20)]

    again = seeds.rng(seeds.SHARD_DRAWS, 3, 2, 1, 0)
    assert draws() == [again.choice(shards).name for _ in range(20)]
    reseeded = seeds.rng(seeds.SHARD_DRAWS, 3, 2, 7, 1, 0)
    assert draws(reseed=7) == [reseeded.choice(shards).name for _ in range(20)] != draws()
    assert list(Resample().epoch_batches(iter("abcde"), plan, 0)) == ["a", "b", "c"]
    with pytest.raises(DataError, match=r"^rank 1: its loader workers' shard draws ran out after 2 of 3 batches"):
        list(Resample().epoch_batches(iter("ab"), plan, 1))


def test_the_seeds_of_every_stream() -> None:
    assert seeds.seed(seeds.SHARD_DRAWS, 0, 3, 1, 0) == "resample-0-3-1-0" and seeds.seed("crop") == "crop"
    assert seeds.number(seeds.CROP, 0, 1, 2) == 4606386405582825792  # a changed number changes every crop
    assert seeds.number(seeds.CROP, 0, 1, 3) != seeds.number(seeds.CROP, 0, 1, 2)
    assert all(0 <= seeds.number(seeds.MIX, i) < 2**63 for i in range(50))
    assert max(seeds.number(seeds.MIX, i) for i in range(50)) >= 2**62
    assert seeds.rng("x", 1).random() == seeds.rng("x", 1).random() != seeds.rng("x", 2).random()


def manifest_of(train: list[int], sha: str = "a", val: list[int] | None = None) -> Manifest:
    splits = {"train": train, "val": val if val is not None else [2]}
    return Manifest(
        base="/x",
        classes=["a"],
        splits={
            k: [ShardInfo(f"{k}-{i}.tar", n, 0, f"{sha}{i}" * 16) for i, n in enumerate(v)] for k, v in splits.items()
        },
    )


def changed(before: Manifest, after: Manifest) -> str:
    with pytest.raises(ConfigError) as raised:
        check_same_shards(shard_entries(before), after)
    return str(raised.value)


def test_a_resume_names_what_changed_in_the_training_shards(caplog: pytest.LogCaptureFixture) -> None:
    saved = manifest_of([3, 4, 5])
    fix = "; resume with the data the run started on, or start a new run"
    lead = "the train shards changed since the checkpoint: "
    assert changed(saved, manifest_of([3, 4])) == f"{lead}train-2.tar is gone from the manifest{fix}"
    assert changed(saved, manifest_of([3, 4, 5, 6])) == f"{lead}train-3.tar was added to the manifest{fix}"
    assert changed(saved, manifest_of([3, 4, 6])) == f"{lead}train-2.tar had 5 samples, now 6{fix}"
    assert changed(saved, manifest_of([3, 4, 5], sha="b")) == (
        f"{lead}train-0.tar had sha256 a0a0a0a0a0a0…, now b0b0b0b0b0b0…{fix}"
    )
    swapped = dataclasses.replace(saved, splits={**saved.splits, "train": list(reversed(saved.splits["train"]))})
    assert changed(saved, swapped) == f"{lead}the shards are listed in another order (sample ids would change){fix}"
    check_same_shards(shard_entries(saved), manifest_of([3, 4, 5]))  # the same: nothing said
    with caplog.at_level(logging.WARNING, logger="raywds"):
        check_same_shards(shard_entries(saved), manifest_of([3, 4, 5], val=[2, 9]))
    assert caplog.messages == [
        "the val shards changed since the checkpoint: val-1.tar was added to the manifest; validation numbers "
        "before and after this resume are not comparable"
    ]


def test_past_listed_shards_a_checkpoint_keeps_the_splits_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = manifest_of([3, 4, 5])
    monkeypatch.setattr(position, "LISTED", 2)
    entries = shard_entries(saved)
    assert entries["train"] == {"fingerprint": saved.fingerprint("train"), "shards": 3}
    assert entries["val"] == [["val-0.tar", 2, "a0" * 16]]
    check_same_shards(entries, manifest_of([3, 4, 5]))
    assert changed(saved, manifest_of([3, 4, 6])) == (
        f"the train shards changed since the checkpoint: fingerprint {saved.fingerprint('train')} (3 shards), now "
        f"{manifest_of([3, 4, 6]).fingerprint('train')} (3 shards); resume with the data the run started on, or "
        "start a new run"
    )
    monkeypatch.setattr(position, "LISTED", 3)
    assert changed(saved, manifest_of([3, 4, 5, 6])).startswith(
        "the train shards changed since the checkpoint: fingerprint of 3 listed shards, now "
    )
    assert grown(shard_entries(saved), manifest_of([3, 4, 5, 6])) is None  # a fingerprint cannot tell an append


def test_an_append_is_more_training_shards_after_the_checkpoints() -> None:
    saved = shard_entries(manifest_of([3, 4, 5]))
    assert grown(saved, manifest_of([3, 4, 5, 6])) == 3
    assert grown(saved, manifest_of([3, 4, 5, 6], val=[2, 1])) == 3
    assert grown(saved, manifest_of([3, 4, 5])) is None, "unchanged"
    assert grown(saved, manifest_of([3, 4])) is None and grown(saved, manifest_of([3, 4, 6, 6])) is None
    assert grown(saved, manifest_of([3, 4, 5, 6], val=[])) is None, "the val split lost its shard"
    assert grown({**saved, "test": [["t.tar", 1, "x"]]}, manifest_of([3, 4, 5, 6])) is None
    assert grown({"val": saved["val"]}, manifest_of([3, 4, 5, 6])) == 0


def test_a_position_round_trips_and_checks_the_data_and_mode() -> None:
    shards = shards_of([4, 4, 4])
    consumed = np.zeros(12, dtype=bool)
    consumed[[0, 1, 2, 3, 5, 6]] = True
    done, partial = per_shard(consumed, shards)
    assert done.tolist() == [4, 2, 0] and list(partial) == [1] and partial[1].tolist() == [False, True, True, False]
    here = Position.of_flags(consumed, shards, mode=Split(), epoch=2, step=3, samples_done=6, dataset="d")
    back = Position.from_state(here.to_state())
    assert (back.mode, back.epoch, back.step, back.samples_done, back.dataset) == (Split(), 2, 3, 6, "d")
    assert back.shards_done is not None and back.shards_done.tolist() == [4, 2, 0]
    assert {i: f.tolist() for i, f in back.partial.items()} == {1: [False, True, True, False]}
    assert back.done() == Done(6, (4, 2, 0))
    drawn = Position.of_flags(None, shards, mode=Resample(), epoch=0, step=1, samples_done=8, dataset="d")
    assert drawn.shards_done is None and drawn.done() == Done(8, None)
    assert Position.from_state(drawn.to_state()).shards_done is None

    assert done_in(here, 2) == Done(6, (4, 2, 0)) and done_in(here, 1) is None and done_in(None, 2) is None
    assert done_in(dataclasses.replace(here, samples_done=0), 2) is None
    named = [ShardInfo(f"n{i}.tar", 4, 0, "") for i in range(3)]
    flags, samples = already_done(here, 2, named)
    assert list(flags) == ["n1.tar"] and samples == 6 and already_done(here, 3, named) == ({}, 0)
    assert already_done(None, 2, named) == ({}, 0)

    manifest = Manifest(base="/x", classes=["a"], splits={"train": shards})
    mine = dataclasses.replace(here, dataset=manifest.fingerprint("train"))
    mine.check_compatible(manifest, Split())
    with pytest.raises(
        ConfigError,
        match=rf"^the checkpoint was taken on other training shards \(fingerprint d, these are "
        rf"{manifest.fingerprint('train')}\); resume with the same --data, or start a new run$",
    ):
        here.check_compatible(manifest, Split())
    with pytest.raises(
        ConfigError,
        match=r"^the checkpoint stopped inside epoch 3 in split mode; resume it with --mode split \(the mode may "
        r"change at an epoch boundary\)$",
    ):
        mine.check_compatible(manifest, Resample())
    dataclasses.replace(mine, step=0).check_compatible(manifest, Resample())  # at the epoch's start: any mode


def test_a_plan_of_made_up_shards(tmp_path: Path) -> None:
    made = plan_shards(None, 3, 10, None)
    assert made == [ShardInfo(f"shard-{i:06d}.tar", 10, 0, "") for i in range(3)]
    assert [s.num_samples for s in plan_shards(None, 3, 10, 4)] == [10, 10, 4]
    for args in [(None, None, 10, None), (None, 3, None, None), (None, 0, 10, None)]:
        with pytest.raises(ConfigError, match=r"^plan needs --data SHARDS, or --num-shards N --samples-per-shard K$"):
            plan_shards(*args)


def test_what_is_left_of_the_shards_and_the_slots_they_are_dealt_to() -> None:
    shards = [ShardInfo(f"s{i}.tar", 4, 400 + i, f"{i}" * 64) for i in range(3)]
    assert remaining(shards, (0, 3, 4)) == [shards[0], ShardInfo("s1.tar", 1, 401, "1" * 64)]
    plan = Split().plan(shards, num_ranks=2, num_workers=2, batch_size=4)
    assert plan.slots == Split().plan(shards, num_ranks=2, num_workers=2, batch_size=4, seed=0, epoch=0).slots
    slots = plan.slots
    assert slots[0:4] == [slots[i] for i in range(4)] == list(slots) and slots[-4] == slots[0]
    with pytest.raises(IndexError, match=r"^4$"):
        slots[4]
    with pytest.raises(IndexError, match=r"^-5$"):
        slots[-5]
