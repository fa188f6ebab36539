"""`raywds evaluate`: a model from a real one-epoch run scored on the uneven shards (9 shards of 1 to
30 samples), its numbers against a plain loop over every sample read straight from the tars (one
process, one batch, no loader): the same counts and confusion at 1, 2 and 3 ranks; the files it
writes; the EMA; a model as an export; shards raywds did not write; and each bad input in one line."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import shutil
import socket
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from support.foreign import shardwriter_shards, write_tar
from support.runs import FORKSERVER_PRELOAD, small_config
from torch import nn

from raywds import cli
from raywds.errors import DataError
from raywds.infer.evaluation import Scoring, Sums, reading_config
from raywds.infer.scorecard import most_confused
from raywds.launch.local import run_local
from raywds.loader.decodings import decoding
from raywds.models.trained import EXPORT_EMA, EXPORT_FORMAT, EXPORT_JSON, EXPORT_WEIGHTS, Trained, load_trained

RANKS_START = "forkserver"  # each rank starts in well under a second (tests/train/test_train.py)
torch.multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
LINE = re.compile(
    r"^top-1 ([\d.]+)  top-5 ([\d.]+)  loss ([\d.]+)  samples (\d+)(  \(EMA top-1 [\d.]+  top-5 [\d.]+  loss [\d.]+\))?$"
)


@pytest.fixture(scope="module")
def run(uneven: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-epoch run of the demo model with --model-ema, on the uneven shards."""
    out = tmp_path_factory.mktemp("evaluated") / "run"
    run_local(small_config(uneven, epochs=1, model_ema=True, model_ema_steps=1, out=str(out)))
    return out


@dataclasses.dataclass
class Counted:
    """What a plain loop over every sample finds."""

    top1: int
    top5: int
    loss_sum: float
    confusion: np.ndarray


def tar_samples(shards: Path, split: str) -> list[tuple[bytes, int]]:
    """(JPEG bytes, label) of every sample of a split, read with tarfile from the tars the manifest lists."""
    manifest = json.loads((shards / "manifest.json").read_text())
    found = []
    for shard in manifest["splits"][split]["shards"]:
        with tarfile.open(shards / shard["name"]) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
        for key in dict.fromkeys(name.split(".", 1)[0] for name in members):
            found.append((members[f"{key}.jpg"], int(members[f"{key}.cls"])))
    return found


def plain_loop(model: nn.Module, trained: Trained, samples: list[tuple[bytes, int]]) -> Counted:
    """Every sample through `model` in one batch: its centre crop as the model was validated on it."""
    crop = decoding("cpu").val_crop(trained.inputs.crop, trained.inputs.resize)
    mean = torch.tensor([m * 255 for m in trained.inputs.mean]).view(1, 3, 1, 1)
    std = torch.tensor([s * 255 for s in trained.inputs.std]).view(1, 3, 1, 1)
    images = (torch.stack([crop(jpeg) for jpeg, _ in samples]).float() - mean) / std
    labels = torch.tensor([label for _, label in samples])
    with torch.no_grad():
        logits = model.eval()(images).float()
    top = logits.topk(5, dim=1).indices
    confusion = np.zeros((len(trained.classes),) * 2, dtype=np.int64)
    np.add.at(confusion, (labels.numpy(), top[:, 0].numpy()), 1)
    losses = nn.functional.cross_entropy(logits, labels, reduction="none").double()
    return Counted(
        int((top[:, 0] == labels).sum()), int((top == labels[:, None]).any(1).sum()), losses.sum().item(), confusion
    )


def confusion_csv(path: Path) -> np.ndarray:
    rows = list(csv.reader(path.open()))
    return np.array([[int(v) for v in row[1:]] for row in rows[1:]], dtype=np.int64)


def assert_same(metrics: dict, confusion: np.ndarray, counted: Counted, samples: int) -> None:
    """Counts exactly, the loss to float rounding."""
    assert metrics["samples"] == samples == int(counted.confusion.sum())
    assert (metrics["correct_top1"], metrics["correct_top5"]) == (counted.top1, counted.top5)
    assert np.array_equal(confusion, counted.confusion)
    assert metrics["loss"] == pytest.approx(counted.loss_sum / samples, rel=1e-5)


def evaluate_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], list[str]]:
    """`raywds evaluate ARGS` in this process: its exit code, and its stdout's and stderr's lines."""
    code = cli.main(["evaluate", *args])
    said = capsys.readouterr()
    return code, said.out.splitlines(), said.err.splitlines()


def _rank(rank: int, world_size: int, port: int, args: list[str]) -> None:
    """One torchrun-like rank of `raywds evaluate`: the world from the environment, as torchrun sets it."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    assert cli.main(["evaluate", *args]) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_every_sample_is_scored_once_at_1_2_and_3_ranks(run: Path, uneven: Path, tmp_path: Path) -> None:
    """The train split's 9 shards of 1 to 30 samples, which no count of ranks divides evenly: the
    counts and the confusion are a plain loop's exactly, at 1 rank with 2 loader workers and at 2
    and 3 ranks as torchrun starts them; a sample scored twice or missed changes them."""
    trained = load_trained(str(run))
    counted = plain_loop(trained.model, trained, tar_samples(uneven, "train"))
    for world_size in (1, 2, 3):
        out = tmp_path / f"ranks{world_size}"
        args = [str(run), "--data", str(uneven), "--split", "train", "--out", str(out), "--batch-size", "7"]
        if world_size == 1:
            assert cli.main(["evaluate", *args, "--loader-workers", "2"]) == 0
        else:
            port = free_port()
            mp.start_processes(
                _rank,
                args=(world_size, port, [*args, "--loader-workers", "0"]),
                nprocs=world_size,
                start_method=RANKS_START,
            )
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["ranks"] == world_size and sum(metrics["samples_per_rank"]) == 120, metrics
        assert_same(metrics, confusion_csv(out / "confusion.csv"), counted, 120)
        assert metrics["splits"] == {"train": 120, "val": 50}


def test_the_files_and_the_line(run: Path, uneven: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The val split by default, into evaluation-val/ in the run folder: the summary line last (the
    EMA's numbers in it, as the run kept one), metrics.json, per_class.csv consistent with the
    matrix, and the most confused pairs as a figure."""
    code, out, err = evaluate_cli(capsys, str(run), "--data", str(uneven), "--loader-workers", "0")
    assert code == 0, err
    folder = run / "evaluation-val"
    assert out[-2].startswith(f"raywds: checkpoint {run} on 50 val samples of {uneven} (1 rank(s))  wrote {folder}/")
    line = LINE.match(out[-1])
    assert line is not None and line.group(5), out[-1]
    metrics = json.loads((folder / "metrics.json").read_text())
    assert (float(line.group(1)), int(line.group(4))) == (round(metrics["top1"], 3), 50)
    trained = load_trained(str(run))
    samples = tar_samples(uneven, "val")
    confusion = confusion_csv(folder / "confusion.csv")
    assert_same(metrics, confusion, plain_loop(trained.model, trained, samples), 50)
    assert metrics["scored"] == "weights" and metrics["source"] == f"checkpoint {run}"
    ema = plain_loop(trained.ema, trained, samples)  # type: ignore[arg-type]
    assert (metrics["ema"]["correct_top1"], metrics["ema"]["correct_top5"]) == (ema.top1, ema.top5)
    rows = list(csv.DictReader((folder / "per_class.csv").open()))
    assert [r["name"] for r in rows] == trained.classes
    assert [int(r["samples"]) for r in rows] == confusion.sum(axis=1).tolist()
    assert [int(r["correct"]) for r in rows] == np.diag(confusion).tolist()
    assert [int(r["predicted"]) for r in rows] == confusion.sum(axis=0).tolist()
    pairs = [
        (trained.classes.index(p["true"]), trained.classes.index(p["predicted"])) for p in metrics["most_confused"]
    ]
    assert [(t, p) for t, p, _ in most_confused(confusion)] == pairs and pairs
    assert (folder / "confused.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_ema_alone_and_an_export(
    run: Path, uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--ema scores the average alone; an export folder of the same weights gives the checkpoint's
    numbers; --ema on an export without an average is one line."""
    trained = load_trained(str(run))
    code, out, err = evaluate_cli(capsys, str(run), "--data", str(uneven), "--ema", "--out", str(tmp_path / "ema"))
    assert code == 0 and out[-1].startswith("EMA top-1 "), (out, err)
    metrics = json.loads((tmp_path / "ema" / "metrics.json").read_text())
    ema = plain_loop(trained.ema, trained, tar_samples(uneven, "val"))  # type: ignore[arg-type]
    assert metrics["scored"] == "ema" and "weights" not in metrics
    assert_same(metrics, confusion_csv(tmp_path / "ema" / "confusion.csv"), ema, 50)
    export = exported(trained, tmp_path / "export", ema=False)
    code, out, err = evaluate_cli(capsys, str(export), "--data", str(uneven), "--split", "train")
    assert code == 0, err
    metrics = json.loads((export / "evaluation-train" / "metrics.json").read_text())
    assert_same(
        metrics,
        confusion_csv(export / "evaluation-train" / "confusion.csv"),
        plain_loop(trained.model, trained, tar_samples(uneven, "train")),
        120,
    )
    assert evaluate_cli(capsys, str(export), "--data", str(uneven), "--ema")[1:] == (
        [],
        [f"raywds: error: --ema: export {export} holds no EMA weights (train with --model-ema); leave out --ema"],
    )


def exported(trained: Trained, folder: Path, *, ema: bool) -> Path:
    """An export folder as raywds.models.trained reads one: model.json and the weights as safetensors."""
    from safetensors.torch import save_file

    folder.mkdir()
    meta = {
        "format": EXPORT_FORMAT,
        "model": trained.name,
        "classes": trained.classes,
        "inputs": trained.inputs.to_dict(),
    }
    (folder / EXPORT_JSON).write_text(json.dumps(meta))
    save_file(trained.model.state_dict(), str(folder / EXPORT_WEIGHTS))
    if ema:
        save_file(trained.ema.state_dict(), str(folder / EXPORT_EMA))  # type: ignore[union-attr]
    return folder


def test_shards_raywds_did_not_write(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ShardWriter's shards named by a brace list, their labels bare integers (5 of the model's 10
    classes): indexed on first use and scored as a plain loop scores them."""
    names = shardwriter_shards(tmp_path / "wds", num_samples=30, maxcount=8)
    data = str(tmp_path / "wds" / "train-{0000..0003}.tar")
    args = ["--data", data, "--split", "train", "--index-cache", str(tmp_path / "index"), "--out", str(tmp_path / "e")]
    code, out, err = evaluate_cli(capsys, str(run), *args)
    assert code == 0, err
    metrics = json.loads((tmp_path / "e" / "metrics.json").read_text())
    samples = []
    for name in names:
        with tarfile.open(tmp_path / "wds" / name) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
        samples += [
            (members[f"{k}.jpg"], int(members[f"{k}.cls"])) for k in dict.fromkeys(n.split(".")[0] for n in members)
        ]
    trained = load_trained(str(run))
    assert_same(
        metrics, confusion_csv(tmp_path / "e" / "confusion.csv"), plain_loop(trained.model, trained, samples), 30
    )


def copy_with(shards: Path, out: Path, **changes: object) -> Path:
    """The shards in another folder, their manifest changed as `changes` say."""
    shutil.copytree(shards, out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, **changes}))
    return out


def test_bad_input_is_one_line(run: Path, uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Classes by another name, integer labels past the model's classes, an empty split, a damaged
    checkpoint and a damaged export: each one line, before anything is written."""
    classes = load_trained(str(run)).classes
    renamed = copy_with(uneven, tmp_path / "renamed", classes=[*classes[:3], "n99999999", *classes[4:]])
    manifest = json.loads((uneven / "manifest.json").read_text())
    no_val = copy_with(uneven, tmp_path / "no-val", splits={"train": manifest["splits"]["train"]})
    labels = [(f"s{i}.jpg", shardwriter_image()) for i in range(3)]
    write_tar(
        tmp_path / "wide" / "train-0.tar",
        [m for i, (name, jpg) in enumerate(labels) for m in ((name, jpg), (f"s{i}.cls", str(5 * i + 1).encode()))],
    )
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes((run / "checkpoint.pt").read_bytes()[:5000])
    export = exported(load_trained(str(run)), tmp_path / "export", ema=False)
    (export / EXPORT_WEIGHTS).write_bytes((export / EXPORT_WEIGHTS).read_bytes()[:100])
    cases = {
        (str(run), str(renamed)): (
            f"the model's 10 classes differ from the 10 of --data {renamed}: class 3 is {classes[3]!r} in the model "
            "and 'n99999999' in the data; score it on data labelled as it was trained (the same classes in the same order)"
        ),
        (str(run), str(tmp_path / "wide" / "train-0.tar")): (
            f"--data {tmp_path / 'wide' / 'train-0.tar'} has labels 0 to 11, but the model has 10 classes (0 to 9): "
            "score it on data labelled as it was trained"
        ),
        (str(run), str(no_val)): (
            f"--data {no_val} has no val samples (it has train (120 samples)): give --split with one of those, "
            "or the shards to score as --val-data"
        ),
        (str(damaged), str(uneven)): f"checkpoint {damaged} is damaged (",
        (str(export), str(uneven)): f"export {export}: {EXPORT_WEIGHTS} is damaged or missing (",
    }
    for (model, data), said in cases.items():
        out = tmp_path / "out"
        code, lines, err = evaluate_cli(
            capsys, model, "--data", data, "--out", str(out), "--index-cache", str(tmp_path / "index")
        )
        assert (code, len(err)) == (1, 1) and not any(LINE.match(line) for line in lines), (model, data, err)
        assert err[0].startswith(f"raywds: error: {said}"), err
        assert not out.exists()


def shardwriter_image() -> bytes:
    from support.foreign import demo_images

    return next(demo_images(1, seed=0))[1]


def test_sums_that_count_a_sample_twice_are_refused(run: Path, uneven: Path) -> None:
    """The samples the ranks scored are checked against the manifest's before anything is said."""
    trained = load_trained(str(run))
    scoring = Scoring.of(trained, reading_config(trained, str(uneven), {"loader_workers": 0}))
    sums = Sums.zeros(2, 10, 2)
    sums.per_rank[:] = torch.tensor([25.0, 26.0])
    with pytest.raises(
        DataError, match=r"^scored 51 samples \(\[25, 26\] by rank\) but the val split of --data .* has 50: "
    ):
        scoring.scored(sums)
