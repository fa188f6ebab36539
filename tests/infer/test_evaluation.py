"""`raywds evaluate`: a model from a real one-epoch run scored on the uneven shards (9 train shards
of 1 to 30 samples), its numbers against a plain loop over every sample read straight from the tars
(support.scoring): the same counts and confusion at 1, 2 and 3 ranks; the files it writes and its
line; the EMA; the model as an export; shards raywds did not write; each bad input in one line.
With --ray: tests/launch/test_ray_evaluation.py."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from support.foreign import demo_images, shardwriter_shards, write_tar
from support.runs import FORKSERVER_PRELOAD, small_config
from support.scoring import assert_same, confusion_csv, plain_loop, split_samples, tar_samples

from raywds.cli import main as cli
from raywds.errors import DataError
from raywds.infer.evaluation import Scoring, Sums, reading_config
from raywds.infer.scorecard import most_confused
from raywds.launch.local import run_local
from raywds.models.export import export_model
from raywds.models.trained import EXPORT_WEIGHTS, load_trained

RANKS_START = "forkserver"  # each rank starts in well under a second (tests/train/test_train.py)
torch.multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # conftest starts it early
LINE = re.compile(
    r"^top-1 ([\d.]+)  top-5 ([\d.]+)  loss ([\d.]+)  samples (\d+)"
    r"(  \(EMA top-1 [\d.]+  top-5 [\d.]+  loss [\d.]+\))?$"
)
"""The summary line `raywds evaluate` ends with."""


@pytest.fixture(scope="module")
def run(uneven: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-epoch run of the demo model with --model-ema, on the uneven shards."""
    out = tmp_path_factory.mktemp("evaluated") / "run"
    run_local(small_config(uneven, epochs=1, model_ema=True, model_ema_steps=1, out=str(out)))
    return out


def evaluate_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], list[str]]:
    """`raywds evaluate ARGS` in this process: its exit code, and its stdout's and stderr's lines."""
    code = cli.main(["evaluate", *args])
    said = capsys.readouterr()
    return code, said.out.splitlines(), said.err.splitlines()


def _rank(rank: int, world_size: int, port: int, args: list[str]) -> None:
    """A rank of `raywds evaluate ARGS` with the world in the environment, as torchrun sets it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    assert cli.main(["evaluate", *args]) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_every_sample_is_scored_once_at_1_2_and_3_ranks(run: Path, uneven: Path, tmp_path: Path) -> None:
    """The train split's 9 shards of 1 to 30 samples, which no count of ranks divides evenly: the
    counts and the confusion are a plain loop's exactly at 1 rank of 2 loader workers, and at 2 and
    3 ranks started as torchrun starts them; a sample scored twice or missed changes them."""
    trained = load_trained(str(run))
    counted = plain_loop(trained.model, trained, split_samples(uneven, "train"))
    for world_size in (1, 2, 3):
        out = tmp_path / f"ranks{world_size}"
        args = [str(run), "--data", str(uneven), "--split", "train", "--out", str(out), "--batch-size", "7"]
        if world_size == 1:
            assert cli.main(["evaluate", *args, "--loader-workers", "2"]) == 0
        else:
            ranks = (world_size, free_port(), [*args, "--loader-workers", "0"])
            mp.start_processes(_rank, args=ranks, nprocs=world_size, start_method=RANKS_START)
        metrics = assert_same(out, counted, 120)
        assert metrics["ranks"] == world_size and sum(metrics["samples_per_rank"]) == 120, metrics
        assert min(metrics["samples_per_rank"]) > 0 and metrics["splits"] == {"train": 120, "val": 50}


def test_the_files_and_the_line(run: Path, uneven: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The val split by default, into evaluation-val/ in the run folder: the summary line last (with
    the EMA's numbers: the run kept one), metrics.json, per_class.csv as the matrix says, and the
    most confused pairs in metrics.json and as a figure."""
    code, out, err = evaluate_cli(capsys, str(run), "--data", str(uneven), "--loader-workers", "0")
    assert code == 0, err
    folder = run / "evaluation-val"
    assert out[-2].startswith(
        f"raywds: scored checkpoint {run} on the 50 val samples of {uneven} (1 rank); wrote {folder}: "
    )
    line = LINE.match(out[-1])
    assert line is not None and line.group(5), out[-1]
    trained = load_trained(str(run))
    samples = split_samples(uneven, "val")
    metrics = assert_same(folder, plain_loop(trained.model, trained, samples), 50)
    assert (line.group(1), line.group(4)) == (f"{metrics['top1']:.3f}", "50")
    assert assert_same(folder, plain_loop(trained.ema, trained, samples), 50, key="ema")  # type: ignore[arg-type]
    assert metrics["scored"] == "weights" and metrics["source"] == f"checkpoint {run}"
    confusion = confusion_csv(folder / "confusion.csv")
    rows = list(csv.DictReader((folder / "per_class.csv").open()))
    assert [r["name"] for r in rows] == trained.classes
    assert [int(r["samples"]) for r in rows] == confusion.sum(axis=1).tolist()
    assert [int(r["correct"]) for r in rows] == np.diag(confusion).tolist()
    assert [int(r["predicted"]) for r in rows] == confusion.sum(axis=0).tolist()
    named = [(trained.classes[t], trained.classes[p], n) for t, p, n in most_confused(confusion)]
    assert [(p["true"], p["predicted"], p["samples"]) for p in metrics["most_confused"]] == named and named
    assert (folder / "confused.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_ema_alone_and_exports(run: Path, uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--ema scores the average alone; `raywds export`'s folder gives the checkpoint's numbers, and
    one of the average alone the average's; --ema on that is one line."""
    trained = load_trained(str(run))
    samples = split_samples(uneven, "train")
    code, out, err = evaluate_cli(capsys, str(run), "--data", str(uneven), "--split", "train", "--ema")
    assert code == 0 and out[-1].startswith("EMA top-1 "), (out, err)
    metrics = assert_same(run / "evaluation-train", plain_loop(trained.ema, trained, samples), 120)  # type: ignore[arg-type]
    assert metrics["scored"] == "ema" and "weights" not in metrics
    for ema in (False, True):
        export = export_model(str(run), tmp_path / f"export-{ema}", ema=ema).folder
        code, out, err = evaluate_cli(capsys, str(export), "--data", str(uneven), "--split", "train")
        assert code == 0, err
        model = trained.ema if ema else trained.model
        assert_same(export / "evaluation-train", plain_loop(model, trained, samples), 120)  # type: ignore[arg-type]
    assert evaluate_cli(capsys, str(export), "--data", str(uneven), "--ema")[1:] == (
        [],
        [f"raywds: error: --ema: export {export} holds no EMA weights (train with --model-ema); leave out --ema"],
    )


def test_shards_raywds_did_not_write(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ShardWriter's shards named by a brace list, their labels bare integers (5 of the model's 10
    classes): indexed on first use and scored as the plain loop scores them."""
    names = shardwriter_shards(tmp_path / "wds", num_samples=30, maxcount=8)
    data = str(tmp_path / "wds" / "train-{0000..0003}.tar")
    args = ["--data", data, "--split", "train", "--index-cache", str(tmp_path / "index"), "--out", str(tmp_path / "e")]
    code, out, err = evaluate_cli(capsys, str(run), *args)
    assert code == 0, err
    trained = load_trained(str(run))
    assert_same(tmp_path / "e", plain_loop(trained.model, trained, tar_samples(tmp_path / "wds", names)), 30)


def copy_with(shards: Path, out: Path, **changes: object) -> Path:
    """The shards in another folder, their manifest changed as `changes` say."""
    shutil.copytree(shards, out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, **changes}))
    return out


def test_bad_input_is_one_line(run: Path, uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Classes by another name, integer labels past the model's classes, an empty split, a damaged
    checkpoint and a damaged export: each one line, and no folder written."""
    classes = load_trained(str(run)).classes
    renamed = copy_with(uneven, tmp_path / "renamed", classes=[*classes[:3], "n99999999", *classes[4:]])
    manifest = json.loads((uneven / "manifest.json").read_text())
    no_val = copy_with(uneven, tmp_path / "no-val", splits={"train": manifest["splits"]["train"]})
    jpeg = next(demo_images(1, seed=0))[1]
    wide = write_tar(
        tmp_path / "wide" / "train-0.tar",
        [(f"s{i}.{e}", v) for i in (1, 6, 11) for e, v in (("jpg", jpeg), ("cls", str(i).encode()))],
    )
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes((run / "checkpoint.pt").read_bytes()[:5000])
    export = export_model(str(run), tmp_path / "export").folder
    (export / EXPORT_WEIGHTS).write_bytes((export / EXPORT_WEIGHTS).read_bytes()[:100])
    cases = {
        (str(run), str(renamed)): (
            f"the model's 10 classes differ from the 10 of --data {renamed}: class 3 is {classes[3]!r} in the "
            "model and 'n99999999' in the data; score it on data labelled as it was trained (the same classes in "
            "the same order)"
        ),
        (str(run), str(wide)): (
            f"--data {wide} has labels 0 to 11, but the model has 10 classes (0 to 9): score it on data labelled "
            "as it was trained"
        ),
        (str(run), str(no_val)): (
            f"--data {no_val} has no val samples (it has train (120 samples)): give --split with one of those, "
            "or the shards to score as --val-data"
        ),
        (str(damaged), str(uneven)): f"checkpoint {damaged} is damaged (",
        (str(export), str(uneven)): f"export {export}: {EXPORT_WEIGHTS} is damaged or missing (",
    }
    out = tmp_path / "out"
    for (model, data), said in cases.items():
        index = ["--index-cache", str(tmp_path / "index")]
        code, lines, err = evaluate_cli(capsys, model, "--data", data, "--out", str(out), *index)
        assert (code, len(err)) == (1, 1) and not any(LINE.match(line) for line in lines), (model, data, err)
        assert err[0].startswith(f"raywds: error: {said}"), err
        assert not out.exists()


def test_sums_that_miss_or_repeat_a_sample_are_refused(run: Path, uneven: Path) -> None:
    """The samples the ranks scored are checked against the manifest's count before any number is said."""
    trained = load_trained(str(run))
    scoring = Scoring.of(trained, reading_config(trained, str(uneven), {"loader_workers": 0}))
    sums = Sums.zeros(2, 10, 2)
    sums.per_rank[:] = torch.tensor([25.0, 26.0])
    with pytest.raises(
        DataError, match=r"^scored 51 samples \(\[25, 26\] by rank\) but the val split of --data .* 50: "
    ):
        scoring.scored(sums)
