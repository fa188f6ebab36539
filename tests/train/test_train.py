"""The training loop without Ray: one process, and two gloo processes in split mode with Join."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.data import UNEVEN_SIZES, epoch_keys, tar_keys
from support.runs import FORKSERVER_PRELOAD, small_config
from torch.nn.parallel import DistributedDataParallel

from raywds.data.manifest import read_manifest
from raywds.errors import CollectiveError, ConfigError
from raywds.loader.loader import val_loader
from raywds.loader.stages import Batch
from raywds.plan.modes import Split
from raywds.plan.position import Position
from raywds.runs.folder import RunDir
from raywds.train.compute import Compute
from raywds.train.config import TrainConfig
from raywds.train.loop import EpochResult, evaluate, train_epoch
from raywds.train.model import DemoNet, build_model
from raywds.train.optim import lr_at
from raywds.train.progress import summary_line
from raywds.train.trainer import train
from raywds.world import World

tiny = small_config

# Ranks start from a fork server: a clean, single-threaded process that has imported torch and
# raywds once, so each rank starts in well under a second (spawn re-imports them, ~3 s a rank)
# and never inherits another thread's lock (a plain fork of this multi-threaded test process can).
RANKS_START = "forkserver"
torch.multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # conftest starts it early


def test_local_training_learns_and_checkpoints(shards: Path, tmp_path: Path) -> None:
    cfg = tiny(shards)
    report = RunDir(tmp_path)
    final = train(cfg, World(), run_dir=report)
    history = [json.loads(line) for line in report.metrics_path.read_text().splitlines()]
    assert [m["epoch"] for m in history] == [1, 2, 3, 4]
    assert history[-1]["train_loss"] < 0.8 * history[0]["train_loss"], history
    assert final["val_samples"] == 50
    assert final["samples_seen"] == 4 * 128  # ceil(120 / 16) = 8 full batches per epoch
    state = torch.load(report.checkpoint_path, weights_only=False)
    assert state["progress"]["epoch"] == 4 and state["classes"] == read_manifest(str(shards)).classes
    model = DemoNet(10)
    model.load_state_dict(state["model"])
    again = evaluate(
        model,
        val_loader(read_manifest(str(shards)), cfg.loader(), World()),
        World(),
        Compute.for_run(cfg, "cpu"),
    )
    assert again["val_top1"] == pytest.approx(final["val_top1"])
    assert summary_line(final).startswith("epochs 4  top-1 ")


def test_a_manifest_without_a_val_split_trains_and_reports_without_validation(shards: Path, tmp_path: Path) -> None:
    """Shards made of a training set alone (the GPU benchmark's are): every epoch trains, none
    validates, and the closing line says so. Before, the first epoch's end failed on the missing
    split, after all of its training, and the summary line needed a top-1."""
    data = tmp_path / "train-only"
    data.mkdir()
    manifest = json.loads((shards / "manifest.json").read_text())
    del manifest["splits"]["val"]
    for shard in manifest["splits"]["train"]["shards"]:
        shutil.copy(shards / shard["name"], data / shard["name"])
    (data / "manifest.json").write_text(json.dumps(manifest))
    report = RunDir(tmp_path / "run")
    final = train(tiny(data, epochs=2), World(), run_dir=report)
    rows = [json.loads(line) for line in report.metrics_path.read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2] and not any("val_top1" in r for r in rows), rows
    assert final["samples_seen"] == 2 * 128 and report.checkpoint_path.is_file()
    assert not (tmp_path / "run" / "best").exists()
    assert summary_line(final).startswith("epochs 2  (no val split)  samples seen 256"), summary_line(final)


def test_device_decoding_trains_on_the_cpu(shards: Path, tmp_path: Path) -> None:
    """`--decode device` on a CPU: the main process decodes the workers' JPEG bytes, and it learns."""
    final = train(tiny(shards, decode="device", epochs=3), World(), run_dir=RunDir(tmp_path))
    assert final["samples_seen"] == 3 * 128 and final["val_samples"] == 50
    assert final["val_top1"] > 0.3, final


def _split_rank(rank: int, cfg: TrainConfig, store: str, out: str) -> None:
    torch.set_num_threads(1)  # one core per rank, as Ray gives each CPU worker
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        metrics = train(cfg, World(rank=rank, world_size=2))
        Path(out, f"rank{rank}.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_split_mode_with_uneven_ranks_finishes_under_join(shards: Path, tmp_path: Path) -> None:
    # 2 ranks x 1 worker: 64 and 56 samples, so 8 and 7 batches of 8; without Join rank 0 would
    # wait in its 8th all-reduce until the 60 s timeout and fail.
    cfg = tiny(shards, mode="split", batch_size=8, epochs=2, loader_workers=1)
    mp.start_processes(
        _split_rank, args=(cfg, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method=RANKS_START
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1], "metrics are all-reduced, so every rank reports the same"
    assert results[0]["train_samples"] == 120, "split mode trains on every sample exactly once"
    assert results[0]["samples_seen"] == 240
    assert results[0]["val_samples"] == 50


def test_learning_rate_warms_up_then_decays_to_zero() -> None:
    cfg = TrainConfig(data="x", lr=0.4, warmup_epochs=1.0, epochs=5)
    rates = [lr_at(cfg, World(), e) for e in (0.0, 0.5, 1.0, 3.0, 5.0)]
    assert rates == pytest.approx([0.0, 0.2, 0.4, 0.2, 0.0])


def test_models_by_name() -> None:
    model = build_model("resnet18", 7)
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 7)
    with pytest.raises(ConfigError, match="unknown model 'resnet7'; did you mean resnet50 or resnet34 or resnet18"):
        build_model("resnet7", 7)


def test_config_errors_name_the_value_and_fix() -> None:
    with pytest.raises(ConfigError, match="batch_size=0 must be at least 1"):
        TrainConfig(data="x", batch_size=0)
    with pytest.raises(ConfigError, match="mode='exact' is not one of resample, split"):
        TrainConfig(data="x", mode="exact")  # type: ignore[arg-type]
    assert TrainConfig(data="x", batch_size=64).peak_lr(world_size=8) == pytest.approx(0.2)


@pytest.mark.parametrize("canonical_nodes", [0, 2])
def test_split_stop_and_resume_trains_the_rest_of_the_epoch_exactly(
    uneven: Path, tmp_path: Path, canonical_nodes: int
) -> None:
    """Also with --canonical-nodes 2 (the run's one node reads both canonical nodes' shards)."""
    audit, out = tmp_path / "audit", tmp_path / "run"
    cfg = tiny(uneven, mode="split", batch_size=8, epochs=2, max_steps=5, audit_dir=str(audit))
    cfg = dataclasses.replace(cfg, out=str(out), canonical_nodes=canonical_nodes)
    report = RunDir(out)
    stopped = train(cfg, World(), run_dir=report)
    assert stopped["inside_epoch"] and stopped["step"] == 5 and stopped["epoch_samples_done"] == 40
    assert sum(epoch_keys(audit, 0, uneven).values()) == 40 and not epoch_keys(audit, 1, uneven)
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["progress"]["position"]["step"] == 5 and state["progress"]["epoch"] == 0

    resumed = dataclasses.replace(cfg, max_steps=None, resume=str(out))
    final = train(resumed, World(), run_dir=RunDir(out, append=True))
    everything = Counter(tar_keys(uneven))
    assert epoch_keys(audit, 0, uneven) == everything, "the two runs together saw epoch 1 exactly once"
    assert epoch_keys(audit, 1, uneven) == everything
    assert final["epoch"] == 2 and final["samples_seen"] == 240 and final["epoch_duplicates"] == 0
    assert final["step"] == 30  # 15 batches of 8 in each epoch
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [5, 15, 30]


def test_resample_resume_continues_the_counters(shards: Path, tmp_path: Path) -> None:
    cfg = tiny(shards, epochs=2, max_steps=3, out=str(tmp_path))
    train(cfg, World(), run_dir=RunDir(tmp_path))
    final = train(dataclasses.replace(cfg, max_steps=None, resume=str(tmp_path / "checkpoint.pt")), World())
    whole = train(dataclasses.replace(cfg, max_steps=None), World())
    assert (
        (final["epoch"], final["step"], final["samples_seen"])
        == (whole["epoch"], whole["step"], whole["samples_seen"])
        == (2, 16, 256)
    )


def test_resume_refuses_other_data(shards: Path, uneven: Path, tmp_path: Path) -> None:
    train(tiny(shards, epochs=1, max_steps=2), World(), run_dir=RunDir(tmp_path))
    with pytest.raises(
        ConfigError, match="the train shards changed since the checkpoint: .* resume with the data the run started on"
    ):
        train(tiny(uneven, epochs=1, resume=str(tmp_path)), World())


def test_resume_names_the_shard_whose_manifest_entry_changed(shards: Path, tmp_path: Path) -> None:
    """Resample mode at an epoch boundary carries no data position, yet an edited manifest is still caught."""
    data = tmp_path / "data"
    shutil.copytree(shards, data)
    train(tiny(data, epochs=1), World(), run_dir=RunDir(tmp_path / "run"))
    manifest = json.loads((data / "manifest.json").read_text())
    edited = manifest["splits"]["train"]["shards"][3]
    edited["sha256"] = "0" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        ConfigError,
        match=rf"the train shards changed since the checkpoint: {edited['name']} had sha256 \w+…, now 000000000000…",
    ):
        train(tiny(data, epochs=2, resume=str(tmp_path / "run")), World())


def test_the_first_warmup_step_already_learns(shards: Path, tmp_path: Path) -> None:
    """A one-step epoch at the start of a warm-up used to run at learning rate 0 and change nothing."""
    cfg = tiny(shards, epochs=1, batches_per_epoch=1, warmup_epochs=1.0, weight_decay=0.0)
    train(cfg, World(), run_dir=RunDir(tmp_path))
    torch.manual_seed(cfg.seed)
    initial = DemoNet(10).state_dict()
    trained = torch.load(tmp_path / "checkpoint.pt", weights_only=False)["model"]
    assert not torch.equal(trained["head.2.weight"], initial["head.2.weight"]), "the one step moved the weights"


def _checkpointing_rank(rank: int, cfg: TrainConfig, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        report = RunDir(Path(out), append=cfg.resume is not None) if rank == 0 else None
        Path(out, f"rank{rank}.json").write_text(json.dumps(train(cfg, World(rank=rank, world_size=2), run_dir=report)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["split", "resample"])
def test_checkpoints_every_few_steps_on_two_ranks_count_each_sample_once(
    uneven: Path, tmp_path: Path, mode: str
) -> None:
    """Several in-epoch checkpoints per epoch on 2 gloo ranks, stopped, then resumed on 2 ranks:
    the counts are right and (split) the audit files hold every key of each epoch exactly once.
    Before the fix, split mode failed its first epoch ('was not exact': every checkpoint summed
    the ranks' counts into the ledger again) and samples_seen grew with every checkpoint."""
    audit, out = tmp_path / "audit", tmp_path / "run"
    cfg = tiny(
        uneven,
        mode=mode,
        batch_size=8,
        epochs=2,
        checkpoint_every_steps=2,
        max_steps=5,
        audit_dir=str(audit),
        out=str(out),
    )
    mp.start_processes(
        _checkpointing_rank, args=(cfg, str(tmp_path / "store"), str(out)), nprocs=2, start_method=RANKS_START
    )
    stopped = json.loads((out / "rank0.json").read_text())
    resumed = dataclasses.replace(cfg, max_steps=None, resume=str(out))
    mp.start_processes(
        _checkpointing_rank, args=(resumed, str(tmp_path / "store2"), str(out)), nprocs=2, start_method=RANKS_START
    )
    final = json.loads((out / "rank0.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [m for m in rows if not m.get("inside_epoch")]
    # Inside epoch 1 at steps 2 and 4, stopped at 5; resumed: 6, then 10, 12, 14 in epoch 2 (8
    # batches a rank in either mode), never at an epoch's last step, where the epoch's own follows.
    assert [m["step"] for m in rows if m.get("inside_epoch")] == [2, 4, 5, 6, 10, 12, 14]
    assert stopped["inside_epoch"] and stopped["epoch"] == 0 and stopped["step"] == 5
    if mode == "split":
        assert epoch_keys(audit, 0, uneven) == epoch_keys(audit, 1, uneven) == Counter(tar_keys(uneven))
        assert [m["epoch_samples"] for m in epochs] == [120, 120] and [m["epoch_duplicates"] for m in epochs] == [0, 0]
        assert [m["samples_seen"] for m in epochs] == [120, 240] and final["samples_seen"] == 240
    else:  # ceil(120 / 16) = 8 full batches of 8 on each rank, each epoch
        assert stopped["samples_seen"] == 5 * 16
        assert [m["samples_seen"] for m in epochs] == [128, 256] and final["samples_seen"] == 256
        assert sum(epoch_keys(audit, 0, uneven).values()) == sum(epoch_keys(audit, 1, uneven).values()) == 128
    assert [m["step"] for m in epochs] == [8, 16]


def _stop_rank(rank: int, cfg: TrainConfig, store: str, out: str, world_size: int = 2) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        report = RunDir(Path(out)) if rank == 0 else None
        world = World(rank=rank, world_size=world_size)
        Path(out, f"rank{rank}.json").write_text(json.dumps(train(cfg, world, run_dir=report)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_split_resume_on_another_world_size_redeals_the_rest(uneven: Path, tmp_path: Path) -> None:
    """Two gloo ranks stop inside epoch 1; one process finishes it: every key once, none repeated."""
    audit, out = tmp_path / "audit", tmp_path / "run"
    cfg = tiny(uneven, mode="split", batch_size=8, epochs=1, max_steps=3, audit_dir=str(audit), out=str(out))
    mp.start_processes(_stop_rank, args=(cfg, str(tmp_path / "store"), str(out)), nprocs=2, start_method=RANKS_START)
    first = epoch_keys(audit, 0, uneven)
    assert sum(first.values()) == 2 * 3 * 8 and max(first.values()) == 1
    final = train(dataclasses.replace(cfg, max_steps=None, resume=str(out)), World())
    assert epoch_keys(audit, 0, uneven) == Counter(tar_keys(uneven))
    assert final["epoch_samples"] == 120 and final["epoch_missing"] == 0 and final["train_samples"] == 120 - 48


@pytest.mark.slow
def test_three_ranks_resuming_an_epoch_with_two_shards_left_finish_it_exactly(uneven: Path, tmp_path: Path) -> None:
    """One process, reading its shards in order (largest first, no shuffle buffer), stops 13 steps of 9
    into the epoch: 117 of 120 samples, the shards of 2 and 1 samples left. Three gloo ranks finish it:
    one gets nothing and waits in Join, one trains on a batch of one sample. No hang, no repeat."""
    audit, out = tmp_path / "audit", tmp_path / "run"
    cfg = tiny(uneven, mode="split", batch_size=9, epochs=1, max_steps=13, audit_dir=str(audit), out=str(out))
    cfg = dataclasses.replace(cfg, loader_workers=1, worker_shuffle_buffer=1)
    train(cfg, World(), run_dir=RunDir(out))
    first, before = epoch_keys(audit, 0, uneven), set(audit.iterdir())
    assert sum(first.values()) == 117 and max(first.values()) == 1
    resumed = dataclasses.replace(cfg, max_steps=None, resume=str(out))
    args = (resumed, str(tmp_path / "store"), str(out), 3)
    mp.start_processes(_stop_rank, args=args, nprocs=3, start_method=RANKS_START)
    assert epoch_keys(audit, 0, uneven) == Counter(tar_keys(uneven)), "every sample once over the stop and the resume"
    later = [f for f in audit.glob("epoch0000-*.ids") if f not in before and f.stat().st_size]
    assert len({f.name.split("-")[1] for f in later}) == 2, "two shards were left for three ranks"
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert results[0]["epoch_missing"] == 0 and results[0]["epoch_samples"] == 120


STALL_TIMEOUT_S = 2


def _stall_rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    # The model's collectives run in a group of both ranks with a short timeout; joining and
    # setting up (the ranks may start seconds apart on a busy machine) keep the long one.
    group = dist.new_group(timeout=timedelta(seconds=STALL_TIMEOUT_S))
    model = DistributedDataParallel(DemoNet(10), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # Rank 0 has 3 batches, rank 1 only 2 and no Join: rank 0's third all-reduce has no partner.
    batches = [Batch(torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)), torch.arange(4), list("abcd"))] * (3 - rank)
    start = time.monotonic()
    try:
        world = World(rank=rank, world_size=2)
        train_epoch(
            model,
            batches,
            optimizer,
            lambda step: 0.01,
            world,
            Compute("cpu", None, False),
            uneven=False,
            where="in epoch 1",
            pg_timeout=STALL_TIMEOUT_S,
        )
        if rank == 1:  # stalled, not dead: rank 0 must give up on its own (within 30 s at most)
            deadline = time.monotonic() + 30
            while not Path(out, "rank0.txt").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        Path(out, f"rank{rank}.txt").write_text("finished")
    except CollectiveError as e:
        Path(out, f"rank{rank}.txt").write_text(f"{time.monotonic() - start:.1f}\n{e}")


@pytest.mark.slow
def test_a_stalled_collective_is_an_error_naming_rank_and_step(tmp_path: Path) -> None:
    mp.start_processes(_stall_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method=RANKS_START)
    seconds, message = (tmp_path / "rank0.txt").read_text().split("\n", 1)
    assert re.match(
        r"rank 0 of 2: a collective failed in epoch 1 step 3 after \d+ s "
        rf"\(process-group timeout {STALL_TIMEOUT_S} s\)",
        message,
    ), message
    assert float(seconds) < 15
    assert (tmp_path / "rank1.txt").read_text() == "finished"


@pytest.mark.slow
def test_a_resumed_epoch_with_nothing_left_for_one_rank_still_finishes(uneven: Path, tmp_path: Path) -> None:
    """Near the end of an epoch the rest may fit in one shard: the idle rank joins at once."""
    cfg = tiny(uneven, mode="split", batch_size=8, epochs=1, max_steps=1, out=str(tmp_path / "run"))
    train(cfg, World(), run_dir=RunDir(tmp_path / "run"))
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    left = range(sum(UNEVEN_SIZES[:3]), sum(UNEVEN_SIZES[:4]))  # only the 16 samples of shard 3 are left
    consumed = np.ones(120, dtype=bool)
    consumed[list(left)] = False
    state["progress"]["position"] = Position.of_flags(
        consumed,
        read_manifest(str(uneven)).shards("train"),
        mode=Split(),
        epoch=0,
        step=13,
        samples_done=104,
        dataset=state["progress"]["position"]["dataset"],
    ).to_state()
    torch.save(state, tmp_path / "nearly.pt")
    resumed = dataclasses.replace(cfg, max_steps=None, resume=str(tmp_path / "nearly.pt"), out=str(tmp_path / "two"))
    mp.start_processes(
        _split_rank, args=(resumed, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method=RANKS_START
    )
    result = json.loads((tmp_path / "rank1.json").read_text())
    assert result["train_samples"] == 16 and result["epoch_samples"] == 120 and result["epoch_missing"] == 0


def test_progress_rows_and_per_rank_metrics(shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny(shards, epochs=1, log_every=0.0, val_every=1)
    report = RunDir(tmp_path)
    final = train(cfg, World(), run_dir=report)
    rows = [json.loads(line) for line in report.metrics_path.read_text().splitlines()]
    progress = [r for r in rows if r.get("kind") == "progress"]
    assert [r["step_in_epoch"] for r in progress] == list(range(1, 9)) and progress[-1]["eta_epoch_s"] == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^epoch 1 step 8/8  loss [\d.]+  lr [\d.e-]+  images/s \d+ \(~1 ranks\)  data wait \d+%  epoch ends in 0 s$",
        out,
        re.M,
    )
    # rank 0's verdict on its own steps so far: in every row, in the log on the first and then every few minutes
    assert all(re.match(r"(rank 0 on \S+ waits|the data is not the bottleneck)", r["doctor_rank0"]) for r in progress)
    assert out.count("\n  doctor (rank 0 so far): ") == 1, out
    assert re.search(r"^epoch 1 step 1/8 .*\n  doctor \(rank 0 so far\): ", out, re.M), out
    assert len(final["images_per_s_per_rank"]) == 1 and 0 <= final["data_wait_max"] <= 1


def test_validation_every_n_epochs_and_always_the_last(shards: Path) -> None:
    rows: list = []
    # Two steps an epoch: the schedule is about epochs, not their length.
    train(tiny(shards, epochs=3, val_every=2, batches_per_epoch=2), World(), lambda m, s: rows.append(m))
    assert ["val_top1" in r for r in rows] == [False, True, True]


def test_best_checkpoint_is_kept_only_when_top1_improves(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    run_dir.start()

    state = {"model": {}, "epoch": 1}
    assert run_dir.keep_best({"epoch": 1, "val_top1": 0.5}, state)
    assert not run_dir.keep_best({"epoch": 2, "val_top1": 0.4}, {**state, "epoch": 2})
    assert not run_dir.keep_best({"epoch": 3}, {**state, "epoch": 3}), "an epoch without validation is never best"
    assert run_dir.keep_best({"epoch": 4, "val_top1": 0.7}, {**state, "epoch": 4})
    assert torch.load(tmp_path / "best" / "checkpoint.pt", weights_only=False)["epoch"] == 4
    assert json.loads((tmp_path / "best" / "metrics.json").read_text())["val_top1"] == 0.7


@pytest.mark.slow
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(shards: Path, tmp_path: Path) -> None:
    """Same seed, split mode: the resumed run sees the same samples per epoch in another order,
    so its weights differ; its results must agree within a stated tolerance (0.1 top-1, 30% loss)."""
    cfg = tiny(shards, mode="split", epochs=5, batch_size=8, out=str(tmp_path / "a"))
    whole = train(cfg, World())
    train(dataclasses.replace(cfg, max_steps=20), World(), run_dir=RunDir(tmp_path / "b"))
    resumed = train(dataclasses.replace(cfg, resume=str(tmp_path / "b")), World())
    assert (resumed["epoch"], resumed["step"], resumed["samples_seen"]) == (
        whole["epoch"],
        whole["step"],
        whole["samples_seen"],
    )
    assert abs(resumed["val_top1"] - whole["val_top1"]) <= 0.1
    assert abs(resumed["val_loss"] - whole["val_loss"]) <= 0.3 * whole["val_loss"]


def test_progress_without_a_terminal_starts_no_thread() -> None:
    """No bar is drawn off a terminal, and none is made: a disabled tqdm still starts tqdm's monitor
    thread, one more thread alive when the DataLoader forks its workers."""
    import threading

    from tqdm import tqdm

    from raywds.train.progress import ProgressLog

    if tqdm.monitor is not None:  # an earlier test's bar started it: stop it, so that a new one shows
        tqdm.monitor.exit()
        tqdm.monitor = None
    before = {t.ident for t in threading.enumerate()}
    progress = ProgressLog(TrainConfig(data="x", log_every=0.0), World(), 0, 10, None)
    progress.update(1, EpochResult(num_samples=8, loss_sum=1.0, seconds=1.0, data_wait_s=0.1), 0.1, "x")
    progress.close()
    assert [t.name for t in threading.enumerate() if t.ident not in before] == []
