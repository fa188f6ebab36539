"""A refused run leaves its --out as it found it. Every check that can refuse `raywds train` (the
data, the flags, the resume checkpoint, the plan, the model, the trackers, the lock) comes before
the first write into the run folder, so a typo in the command that reruns into a finished run's
folder cannot wipe that run's record.

Each refusal in REFUSALS runs, through raywds.cli.main in this process, against a copy of one
finished run's folder whose lock file names a run that was killed (as after a crash); the copy
must come back byte for byte: the same files and folders, the same bytes. A new refusal is one
line in REFUSALS."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.runs import small_config

from raywds.cli.main import main
from raywds.launch.local import train_in_process
from raywds.runs import files

TRAIN = ["train", "--model", "demo", "--epochs", "1", "--batch-size", "8", "--image-size", "24"]
"""A run like the finished one; each refusal's flags come after these (the last of a flag wins)."""
KILLED = b"process 4000000 on a-machine-that-went-away\n"
"""The lock file of a run killed while it trained (no process has that PID)."""


@dataclass(frozen=True)
class Refusal:
    what: str
    flags: list[str]
    """After TRAIN and `--data {shards} --out {run}`; {…} names a path of `paths`."""
    said: str
    """The error's text (formatted with the same paths), in the line that says `error:`."""
    code: int = 1
    hidden: tuple[str, ...] = ()
    """Modules that do not import, as where their package is not installed."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables set for the run."""
    held: bool = False
    """Another process holds the run folder's lock."""


REFUSALS = [
    Refusal("an empty --data folder", ["--data", "{empty}"], "no manifest at {empty}/manifest.json: run `raywds"),
    Refusal(
        "--data that does not exist", ["--data", "{empty}/nowhere"], "no manifest at {empty}/nowhere/manifest.json"
    ),
    Refusal("--data foo://x", ["--data", "foo://x"], "foo://x: raywds does not read foo:// locations"),
    Refusal("a flag's value argparse refuses", ["--epochs", "x"], "argument --epochs: invalid int value: 'x'", 2),
    Refusal("a flag's value the config refuses", ["--lr", "-1"], "--lr -1.0 must "),
    Refusal("an unknown tracker", ["--tracking", "neptune"], "argument --tracking: invalid choice: 'neptune'", 2),
    Refusal(
        "--tracking mlflow without mlflow",
        ["--tracking", "mlflow"],
        "--tracking mlflow needs the mlflow package, which does not import here",
        hidden=("mlflow", "mlflow.tracking"),
    ),
    Refusal(
        "--tracking mlflow at a server that does not answer",
        ["--tracking", "mlflow"],
        "--tracking mlflow: the MLflow server at http://127.0.0.1:9 (MLFLOW_TRACKING_URI) does not answer",
        env=(("MLFLOW_TRACKING_URI", "http://127.0.0.1:9"),),
    ),
    Refusal(
        "--tensorboard without tensorboard",
        ["--tensorboard"],
        "--tensorboard needs the tensorboard package, which does not import here",
        hidden=("tensorboard", "torch.utils.tensorboard"),
    ),
    Refusal("an unknown model", ["--model", "nonet"], "unknown model 'nonet'; use demo"),
    Refusal(
        "a split plan with fewer shards than slots",
        ["--mode", "split", "--loader-workers", "9"],
        "split mode needs at least one shard per (rank, loader worker): 8 shards < 1 ranks x 9 workers",
    ),
    Refusal(
        "--auto-augment where the device decodes",
        ["--auto-augment", "ra", "--decode", "device"],
        "--auto-augment and --random-erase change the decoded crop in the loader workers",
    ),
    Refusal("--resume of no checkpoint", ["--resume", "{empty}"], "no checkpoint at {empty}"),
    Refusal("--resume of a file not a checkpoint", ["--resume", "{finished}/config.json"], "{finished}/config.json"),
    Refusal(
        "--resume of the finished run",
        ["--resume", "{run}"],
        "has already trained 1 epochs, and --epochs is 1: nothing is left to train",
    ),
    Refusal(
        "--resume of another run, on other data",
        ["--resume", "{finished}", "--data", "{uneven}", "--epochs", "2"],
        "the train shards changed since the checkpoint",
    ),
    Refusal(
        "--resume with another --model",
        ["--resume", "{finished}", "--epochs", "2", "--model", "resnet18"],
        "the checkpoint was trained as --model demo, not resnet18: resume with --model demo",
    ),
    Refusal(
        "weights of another architecture",
        ["--initial-checkpoint", "{finished}", "--model", "resnet18"],
        "the weights raywds checkpoint {finished} do not fit this --model: ",
    ),
    Refusal("a run folder another process holds", [], "run folder {run} is in use by process {holder} on ", held=True),
]


def contents(folder: Path) -> dict[str, str | None]:
    """Every file (its sha256) and folder (None) under `folder`, by relative path."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture(scope="module")
def finished(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run's folder: one epoch of the demo model on `shards`, with best/ and TensorBoard's files."""
    run = tmp_path_factory.mktemp("finished") / "run"
    cfg = small_config(shards, epochs=1, batch_size=8, image_size=24, loader_workers=0, tensorboard=True, out=str(run))
    train_in_process(cfg)
    names = {p.name for p in run.iterdir()}
    assert {files.METRICS, files.CONFIG, files.CHECKPOINT, files.LAST_STEP, files.BEST, files.TENSORBOARD} <= names
    return run


@contextlib.contextmanager
def held_by_another_process(run: Path) -> Iterator[int]:
    """The run folder's lock, held by a process of its own (as by a run training there); its PID."""
    script = (
        "import sys; from raywds.runs.lock import RunLock; held = RunLock(sys.argv[1]).acquire(); print(1); input()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "1\n"
        yield holder.pid
    finally:
        holder.communicate("\n", timeout=60)


def refused(args: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int | str | None, str]:
    """`raywds ARGS` in this process: its exit code and the line of its stderr that says `error:`."""
    capfd.readouterr()
    try:
        code: int | str | None = main(args)
    except SystemExit as e:  # argparse's
        code = e.code
    err = capfd.readouterr().err
    return code, next((line for line in err.splitlines() if ": error: " in line), err)


@pytest.mark.parametrize("refusal", REFUSALS, ids=[r.what for r in REFUSALS])
def test_a_refused_run_leaves_the_run_folder_as_it_was(
    refusal: Refusal,
    finished: Path,
    shards: Path,
    uneven: Path,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = shutil.copytree(finished, tmp_path / "run")
    (run / files.LOCK).write_bytes(KILLED)
    (tmp_path / "empty").mkdir()
    paths = dict(run=run, finished=finished, shards=shards, uneven=uneven, empty=tmp_path / "empty")
    monkeypatch.chdir(tmp_path)  # whatever a tracker would write where it runs, it writes here
    for name in refusal.hidden:
        monkeypatch.setitem(sys.modules, name, None)
    for name, value in refusal.env:
        monkeypatch.setenv(name, value)
    args = [*TRAIN, "--data", str(shards), "--out", str(run), *(f.format(**paths) for f in refusal.flags)]
    with held_by_another_process(run) if refusal.held else contextlib.nullcontext() as holder:
        paths["holder"] = holder
        before = contents(run)
        code, line = refused(args, capfd)
        after = contents(run)
    assert after == before
    assert code == refusal.code and refusal.said.format(**paths) in line, line


def test_a_refusal_adds_no_lock_file_to_a_folder_that_had_none(
    finished: Path, shards: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A folder that was not a run's (or a run's from before the lock) gets no lock file from a
    run that was refused; a new folder is left empty."""
    run = shutil.copytree(finished, tmp_path / "run")
    (run / files.LOCK).unlink()
    before = contents(run)
    code, line = refused([*TRAIN, "--data", str(tmp_path / "nowhere"), "--out", str(run)], capfd)
    assert code == 1 and "no manifest at" in line
    assert contents(run) == before
    code, line = refused([*TRAIN, "--model", "nonet", "--data", str(shards), "--out", str(tmp_path / "new")], capfd)
    assert code == 1
    assert contents(tmp_path / "new") == {}
