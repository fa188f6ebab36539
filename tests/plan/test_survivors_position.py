"""The resume position at its edges: a split one side of a resume lacks, a shard with one sample
done, a mode changed after a single step, and flags that come back from a checkpoint as flags."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from raywds.data.manifest import Manifest, ShardInfo
from raywds.errors import ConfigError
from raywds.plan.position import Position, check_same_shards, per_shard, shard_entries
from raywds.plan.resample import Resample
from raywds.plan.split import Split


def manifest_of(**splits: list[int]) -> Manifest:
    return Manifest(
        base="/x",
        classes=["a"],
        splits={k: [ShardInfo(f"{k}-{i}.tar", n, 0, f"{i}" * 64) for i, n in enumerate(v)] for k, v in splits.items()},
    )


def test_a_split_the_checkpoint_had_and_the_data_lacks_is_said(caplog: pytest.LogCaptureFixture) -> None:
    saved = shard_entries(manifest_of(train=[3, 4], test=[2]))
    with caplog.at_level(logging.WARNING, logger="raywds"):
        check_same_shards(saved, manifest_of(train=[3, 4]))
    assert caplog.messages == [
        "the test shards changed since the checkpoint: test-0.tar is gone from the manifest; validation numbers "
        "before and after this resume are not comparable"
    ]


def test_a_training_split_the_checkpoint_lacked_is_refused() -> None:
    saved = shard_entries(manifest_of(val=[2]))
    with pytest.raises(
        ConfigError,
        match=r"^the train shards changed since the checkpoint: train-0\.tar was added to the manifest; resume with "
        r"the data the run started on, or start a new run$",
    ):
        check_same_shards(saved, manifest_of(train=[3], val=[2]))


def test_a_shard_with_one_sample_done_is_partly_done() -> None:
    shards = [ShardInfo("a.tar", 4, 0, ""), ShardInfo("b.tar", 4, 0, "")]
    consumed = np.zeros(8, dtype=bool)
    consumed[5] = True
    done, partial = per_shard(consumed, shards)
    assert done.tolist() == [0, 1] and {i: f.tolist() for i, f in partial.items()} == {1: [False, True, False, False]}


def test_a_position_brings_back_its_partial_flags_as_flags() -> None:
    shards = [ShardInfo("a.tar", 5, 0, "")]
    consumed = np.array([True, False, True, True, False])
    back = Position.from_state(
        Position.of_flags(consumed, shards, mode=Split(), epoch=0, step=1, samples_done=3, dataset="d").to_state()
    )
    assert back.partial[0].dtype == np.bool_
    assert np.arange(5)[back.partial[0]].tolist() == [0, 2, 3]


def test_a_mode_changed_after_one_step_is_refused() -> None:
    manifest = manifest_of(train=[4])
    here = Position(
        mode=Split(), epoch=0, step=1, samples_done=2, shards_done=None, dataset=manifest.fingerprint("train")
    )
    with pytest.raises(ConfigError, match=r"^the checkpoint stopped inside epoch 1 in split mode"):
        here.check_compatible(manifest, Resample())
