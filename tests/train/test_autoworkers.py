"""`--loader-workers auto`: the count each epoch trains with, chosen from the last epoch's
stages, within the rank's cores; and whole runs in which it chooses more workers where decoding
is the limit than where the model is, with split epochs still exact."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from support.data import epoch_keys, tar_keys
from support.runs import FORKSERVER_PRELOAD, made_stages, small_config

from raywds.cli.main import main
from raywds.errors import ConfigError
from raywds.runs.folder import RunDir
from raywds.train.autoworkers import MARGIN, Workers, after, first
from raywds.train.config import TrainConfig
from raywds.train.trainer import train
from raywds.world import World

mp.set_forkserver_preload(FORKSERVER_PRELOAD)


def test_the_first_epoch_leaves_a_core_for_the_rank() -> None:
    assert first(8).workers == 7
    assert first(2).workers == 1
    assert first(1).workers == 1


def test_enough_workers_for_the_model_with_a_margin_within_the_cores() -> None:
    assert after(made_stages((100, 350, 800)), cores=16).workers == 5  # ceil(1.15 x 3.5)
    assert after(made_stages((100, 350, 800)), cores=4).workers == 4
    assert "5 worker(s) keep up; 4 core(s) a rank allow 4" in after(made_stages((100, 350, 800)), cores=4).why
    assert after(made_stages((1000, 80, 800)), cores=16).workers == 1  # the model is the limit: one worker is plenty
    assert after(made_stages((100, 100 / MARGIN, 800)), cores=16).workers == 1
    assert after(made_stages((100, 100 / MARGIN + 1, 800)), cores=16).workers == 2


def test_the_slowest_workers_against_the_slowest_model_set_every_ranks_count() -> None:
    """Ranks step together: rank 2's model sets the pace (100/s), rank 1's workers are the slowest."""
    choice = after(made_stages((200, 350, 800), (60, 350, 800), (400, 100, 800)), cores=16)
    assert choice.workers == 2, choice  # ceil(1.15 x 100 / 60); 7 for rank 1's own model
    assert choice.why.startswith("rank 1 on node's loader made 60 images/s a worker and the model takes 100/s"), choice


def test_an_untimed_loader_keeps_its_count() -> None:
    untimed = made_stages((100, 350, 800), workers=3)
    untimed["decoded"] = [0]
    assert after(untimed, cores=16).workers == 3


def test_auto_is_a_flag_value_and_nothing_else_is(shards: Path) -> None:
    assert TrainConfig(data="x", loader_workers="auto").loader_workers == "auto"
    for wrong in ("many", -1, True):
        with pytest.raises(ConfigError, match="loader_workers"):
            TrainConfig(data="x", loader_workers=wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="chosen at each epoch's start"):
        assert TrainConfig(data="x", loader_workers="auto").loader_worker_count
    assert main(["plan", "--data", str(shards), "--workers", "auto"]) == 1


def _rank_with_cores(rank: int, cores: list[int], store: str, out: str) -> None:
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: cores[rank]]))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        workers = Workers(TrainConfig(data="x", loader_workers="auto"), World(rank=rank, world_size=2))
        start = workers.config(0).loader_worker_count
        workers.measured({"stages": made_stages((50, 350, 800), (50, 350, 800))})  # decoding: all the cores it may
        Path(out, f"rank{rank}").write_text(f"{start} {workers.config(1).loader_worker_count}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two gloo processes from a fork server
def test_ranks_with_different_cores_choose_the_same_count(tmp_path: Path) -> None:
    """A split plan is the same on every rank only if every rank has the same count: the fewest
    cores any rank has bound it (rank 1 here is held to one core, rank 0 has them all)."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: every rank has the same")
    mp.start_processes(
        _rank_with_cores, args=([cores, 1], str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="forkserver"
    )
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == "1 1"


def chosen(run: Path) -> list[tuple[int, str]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["stages"]["loader_workers"], r["loader_workers_auto"]) for r in rows if "stages" in r]


def auto(cfg: TrainConfig, **overrides: object) -> TrainConfig:
    return dataclasses.replace(cfg, **{"loader_workers": "auto", "mode": "split", **overrides})


@pytest.mark.slow
def test_auto_chooses_more_workers_where_decoding_is_the_limit_and_split_stays_exact(
    large: Path, shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cores = World().cores
    if cores < 2:
        pytest.skip("one core a rank: auto has one worker to choose")
    decoding = small_config(str(large), decode="pil", image_size=32, batch_size=8, epochs=2)
    with caplog.at_level(logging.INFO, logger="raywds.train.autoworkers"):
        train(auto(decoding, audit_dir=str(tmp_path / "audit")), World(), run_dir=RunDir(tmp_path / "decoding"))
    (start, _), (decode_bound, why) = chosen(tmp_path / "decoding")
    assert start == cores - 1 and decode_bound == min(cores, decode_bound) >= 2, why
    assert "keep up" in why, why
    assert f"epoch 2: {decode_bound} loader worker(s) a rank (auto: {why})" in caplog.text, caplog.text
    for epoch in range(2):  # the plan was made for each epoch's count: every sample once
        assert epoch_keys(tmp_path / "audit", epoch, large) == Counter(tar_keys(large)), f"epoch {epoch + 1}"
    model = small_config(str(shards), model="resnet18", image_size=64, epochs=2, batches_per_epoch=4)
    train(auto(model, mode="resample"), World(), run_dir=RunDir(tmp_path / "model"))
    (_, _), (compute_bound, why_model) = chosen(tmp_path / "model")
    assert compute_bound == 1 < decode_bound, (why_model, why)
