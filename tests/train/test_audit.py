"""`raywds audit`: a real run's audit files prove each epoch exact; a repeat, a loss and a
redone segment in them are told apart."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.runs import small_config

from raywds.cli.main import main
from raywds.runs.folder import RunDir
from raywds.train.audit import kept
from raywds.train.trainer import train
from raywds.world import World


@pytest.fixture(scope="module")
def audited_run(uneven: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A split run of 2 epochs, stopped inside epoch 1 and resumed: its audit folder."""
    out = tmp_path_factory.mktemp("audited")
    cfg = small_config(uneven, mode="split", batch_size=8, epochs=2, max_steps=5, audit_dir=str(out / "audit"))
    train(cfg, World(), run_dir=RunDir(out / "run"))
    train(dataclasses.replace(cfg, max_steps=None, resume=str(out / "run")), World())
    return out / "audit"


def test_a_stopped_and_resumed_run_is_exact_by_its_audit(
    audited_run: Path, uneven: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", str(audited_run), "--data", str(uneven)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "epoch 1: 120 samples, each once",
        "epoch 2: 120 samples, each once",
        f"raywds: 2 epochs in {audited_run}: every sample exactly once in each",
    ]


def test_a_repeated_and_a_lost_sample_are_named(
    audited_run: Path, uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = shutil.copytree(audited_run, tmp_path / "audit")
    first, *_ = sorted(broken.glob("epoch0001-*.ids"))
    ids = np.fromfile(first, dtype="<i8")
    ids[-1] = ids[0]  # the first sample twice, the last one never
    ids.tofile(first)
    assert main(["audit", str(broken), "--data", str(uneven)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "epoch 1: 120 samples, each once"
    lost = int(np.fromfile(audited_run / first.name, dtype="<i8")[-1])
    first_wrong = min(lost, int(ids[0]))
    assert re.fullmatch(
        rf"epoch 2: 1 repeated, 1 missing; first, sample \d+ of [\w-]+\.tar \(id {first_wrong}\) "
        r"was trained on [02] times",
        out.splitlines()[1],
    ), out
    assert err.strip() == "raywds: error: epochs 2 of 2 did not train every sample exactly once"


def test_what_an_attempt_trained_after_the_checkpoint_its_successor_resumed_from_is_left_out(tmp_path: Path) -> None:
    """Attempt 1 started at step 0, checkpointed at 4 and 8, died at 10; attempt 2 resumed from 8:
    attempt 1's segment from 8 on was redone, so it is not counted."""

    def name(rank: int, start: int, attempt: int, at: int) -> str:
        return f"epoch0000-rank{rank:05d}-from{start:07d}-attempt{attempt}-at{at:07d}-pid1.ids"

    files = [name(0, 0, 100, 0), name(0, 0, 100, 4), name(0, 0, 100, 8), name(0, 8, 200, 8), name(1, 8, 200, 8)]
    for f in files:
        (tmp_path / f).write_bytes(b"")
    assert sorted(p.name for p in kept(tmp_path)[0]) == sorted(files[:2] + files[3:])


def test_an_epoch_before_an_append_is_checked_against_the_data_as_it_was(
    uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The audit files say how many samples each epoch's plan covered: an epoch on the first 38
    (the first 3 shards, before an append added the other 82) is exact on those and says so; the
    next, on all 120, is checked against all; a size no first shards add up to is one line."""

    def epoch(index: int, of: int, ids: range) -> None:
        name = f"epoch{index:04d}-rank00000-from0000000-attempt1-at0000000-of{of:07d}-pid1.ids"
        np.array(list(ids), dtype="<i8").tofile(tmp_path / name)

    epoch(0, 38, range(38))
    epoch(1, 120, range(120))
    assert main(["audit", str(tmp_path), "--data", str(uneven)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "epoch 1: 38 samples, each once (before an append added 82 samples)",
        "epoch 2: 120 samples, each once",
        f"raywds: 2 epochs in {tmp_path}: every sample exactly once in each",
    ]
    epoch(2, 38, range(37))
    assert main(["audit", str(tmp_path), "--data", str(uneven)]) == 1
    assert capsys.readouterr().out.splitlines()[2] == (
        "epoch 3: 0 repeated, 1 missing; first, sample 6 of uneven-train-000002.tar (id 37) was trained on 0 times "
        "(before an append added 82 samples)"
    )
    epoch(3, 39, range(39))
    assert main(["audit", str(tmp_path), "--data", str(uneven)]) == 1
    assert capsys.readouterr().err.strip() == (
        "raywds: error: epoch 4 trained over a training split of 39 samples, and no first shards of this one "
        "(120 samples) hold that many: audit with the run's own --data"
    )
