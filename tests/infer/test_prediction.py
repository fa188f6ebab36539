"""`raywds predict`: a model from a real one-epoch run predicts the uneven shards (9 train shards of
1 to 30 samples, 4 val shards), its parts read back with pyarrow: every key once at 1 and 2 ranks,
one part per shard; each probability the model's softmax on the same centre crop (a plain loop over
the tars); a real SIGKILL mid-run, then a rerun that keeps the parts written and ends with each
key once; a folder of images; an undecodable image as a row with its reason; a shard gone mid-run
in one line, the parts before it kept; each refusal in one line. With --ray:
tests/launch/test_prediction_ray.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import pyarrow.dataset as pads
import pytest
import torch
import torch.multiprocessing as mp
from support import shardedit
from support.data import tar_keys
from support.planted import planted_slowness
from support.runs import FORKSERVER_PRELOAD, small_config

from raywds.cli import main as cli
from raywds.infer.prediction import predict_rank
from raywds.infer.predictoptions import Prediction
from raywds.launch.local import run_local
from raywds.loader.decodings import decoding
from raywds.models.trained import load_trained
from raywds.world import World

RANKS_START = "forkserver"  # each rank starts in well under a second (tests/train/test_train.py)
torch.multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
SUMMARY = re.compile(
    r"^raywds: predicted (\d+) samples \((\d+) errors\) in (\d+) parts into (.+) \(([\d.]+) s, (\d+) images/s\)"
    r"(; (\d+) parts were already there)?$"
)
"""The line `raywds predict` ends with."""
ALL_KEYS = 170  # 120 train samples in 9 shards, 50 val samples in 4


@pytest.fixture(scope="module")
def run(uneven: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-epoch run of the demo model on the uneven shards."""
    out = tmp_path_factory.mktemp("predicted") / "run"
    run_local(small_config(uneven, epochs=1, loader_workers=0, out=str(out)))
    return out


def predict(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], list[str]]:
    """`raywds predict ARGS` in this process: its exit code, and its stdout's and stderr's lines."""
    code = cli.main(["predict", *args])
    said = capsys.readouterr()
    return code, said.out.splitlines(), said.err.splitlines()


def rows(out: Path) -> list[dict]:
    """Every row of the predictions in `out`, as pyarrow reads the folder: one table."""
    return pads.dataset(str(out)).to_table().to_pylist()


def shard_keys(shards: Path) -> dict[str, list[str]]:
    """Each shard's keys (by name, .tar left out), read straight from the tars."""
    manifest = json.loads((shards / "manifest.json").read_text())
    found = {}
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            with tarfile.open(shards / shard["name"]) as tar:
                keys = dict.fromkeys(m.name.split(".", 1)[0] for m in tar.getmembers())
            found[shard["name"]] = list(keys)
    return found


def assert_each_key_once(out: Path, shards: Path) -> list[dict]:
    """Every key of the shards exactly once, each in its shard's part, one part per shard."""
    read = rows(out)
    keys = Counter(r["key"] for r in read)
    assert sorted(keys.elements()) == sorted(tar_keys(shards, "train") + tar_keys(shards, "val"))
    assert max(keys.values()) == 1
    expected = shard_keys(shards)
    assert {r["shard"] for r in read} == set(expected)
    for name, keys_of in expected.items():
        assert sorted(r["key"] for r in read if r["shard"] == name) == sorted(keys_of), name
    assert sorted(p.name for p in out.glob("*.parquet")) == sorted(n.replace(".tar", ".parquet") for n in expected)
    return read


def _rank(rank: int, world_size: int, port: int, args: list[str], said: Path) -> None:
    """A rank of `raywds predict ARGS` with the world in the environment, as torchrun sets it; what
    it prints goes to `said`/rank{rank}.txt."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    with (said / f"rank{rank}.txt").open("w") as out, contextlib.redirect_stdout(out):
        assert cli.main(["predict", *args]) == 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_every_key_once_at_one_rank_of_two_workers(
    run: Path, uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Batches of 7 span shards of 1 to 30 samples, two loader workers' shards interleave in them:
    each part is written once its shard is whole, every key once; the line says so."""
    out = tmp_path / "preds"
    code, said, err = predict(capsys, str(run), "--data", str(uneven), "--out", str(out), "--batch-size", "7")
    assert code == 0, err
    line = SUMMARY.match(said[-1])
    assert line is not None and line.group(1, 2, 3, 4) == (str(ALL_KEYS), "0", "13", str(out)), said[-1]
    read = assert_each_key_once(out, uneven)
    trained = load_trained(str(run))
    labels = {key: int(cls) for key, cls in cls_members(uneven).items()}
    for r in read:
        assert r["label"] == labels[r["key"]] and r["error"] is None
        assert r["top_names"] == [trained.classes[c] for c in r["top_classes"]] and len(r["top_classes"]) == 5
        assert r["top_probs"] == sorted(r["top_probs"], reverse=True)


def cls_members(shards: Path) -> dict[str, bytes]:
    """Each sample's .cls member, by key, read straight from the tars."""
    found = {}
    for name in shard_keys(shards):
        with tarfile.open(shards / name) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".cls"):
                    found[m.name.split(".", 1)[0]] = tar.extractfile(m).read()  # type: ignore[union-attr]
    return found


@pytest.mark.slow
def test_every_key_once_at_two_ranks(run: Path, uneven: Path, tmp_path: Path) -> None:
    """Two ranks started as torchrun starts them deal the 13 uneven shards between them and each
    writes its own parts: every key once, every part once, and rank 0's line counts each once (a
    shard predicted by both ranks would count twice)."""
    out = tmp_path / "preds"
    args = [str(run), "--data", str(uneven), "--out", str(out), "--batch-size", "7", "--loader-workers", "0"]
    mp.start_processes(_rank, args=(2, free_port(), args, tmp_path), nprocs=2, start_method=RANKS_START)
    assert_each_key_once(out, uneven)
    line = SUMMARY.match((tmp_path / "rank0.txt").read_text().splitlines()[-1])
    assert line is not None and line.group(1, 2, 3) == (str(ALL_KEYS), "0", "13")
    assert (tmp_path / "rank1.txt").read_text() == ""


def test_probabilities_are_the_softmax_of_a_plain_loop(run: Path, uneven: Path, tmp_path: Path) -> None:
    """Keys of a val shard and of the largest train shard: the top-5 classes and probabilities are
    those of the model on the sample's centre crop, cropped, normalised and run one at a time."""
    out = tmp_path / "preds"
    assert cli.main(["predict", str(run), "--data", str(uneven), "--out", str(out), "--loader-workers", "0"]) == 0
    by_key = {r["key"]: r for r in rows(out)}
    trained = load_trained(str(run))
    crop = decoding("cpu").val_crop(trained.inputs.crop, trained.inputs.resize)
    mean = torch.tensor([m * 255 for m in trained.inputs.mean]).view(1, 3, 1, 1)
    std = torch.tensor([s * 255 for s in trained.inputs.std]).view(1, 3, 1, 1)
    checked = 0
    for name in ("uneven-train-000001.tar", "imagenet-val-000002.tar"):
        with tarfile.open(uneven / name) as tar:
            jpegs = {m.name[:-4]: tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".jpg")}  # type: ignore[union-attr]
        for key, jpeg in list(jpegs.items())[:4]:
            with torch.no_grad():
                probs = trained.model.eval()((crop(jpeg)[None].float() - mean) / std).softmax(dim=1)[0]
            top = probs.topk(5)
            assert by_key[key]["top_classes"] == top.indices.tolist(), key
            assert by_key[key]["top_probs"] == pytest.approx(top.values.tolist(), abs=1e-6), key
            checked += 1
    assert checked == 8


class ThreadsSeen(torch.nn.Module):
    """A model that notes torch's thread count at each batch (its scores: a linear map of the mean pixel)."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.head = torch.nn.Linear(3, num_classes)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return self.head(x.mean(dim=(2, 3)))


def test_the_model_runs_on_the_cores_the_loader_workers_leave(
    run: Path, uneven: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU the model's threads are the rank's cores less its loader workers' (at least one),
    not torch's every core, which wait on the cores the workers decode on; OMP_NUM_THREADS, where set
    (Ray sets it to a task's CPUs), decides instead; torch's count is as it was afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores, before = World().cores, torch.get_num_threads()
    trained = load_trained(str(run))
    try:
        for workers, omp, threads in ((0, None, cores), (1, None, max(1, cores - 1)), (1, "3", cores)):
            if omp is not None:
                monkeypatch.setenv("OMP_NUM_THREADS", omp)
            torch.set_num_threads(cores)  # torch's default: every core
            trained.model = model = ThreadsSeen(len(trained.classes))
            job = Prediction(model=str(run), data=str(uneven), out=str(tmp_path / f"{workers}-{omp}"))
            assert predict_rank(job, {"loader_workers": workers}, World(), trained=trained).samples == ALL_KEYS
            assert set(model.seen) == {threads}, (workers, omp)
            assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)


def written(part: Path) -> tuple[bytes, int, int]:
    """A part's bytes, and the file they are in (its inode and when it was written)."""
    return part.read_bytes(), part.stat().st_ino, part.stat().st_mtime_ns


@pytest.mark.slow
def test_a_killed_predict_resumes_keeping_its_parts(
    run: Path, uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `raywds predict` whose forward pass is slowed is SIGKILLed once a part is written (before
    all are); run again, it keeps those parts byte for byte, writes the rest, and each key is once."""
    out = tmp_path / "preds"
    args = [str(run), "--data", str(uneven), "--out", str(out), "--batch-size", "8", "--loader-workers", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **planted_slowness.environment(0.3)}
    command = [sys.executable, "-m", "raywds", "predict", *args]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob("*.parquet")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    before = {p.name: written(p) for p in out.glob("*.parquet")}
    assert 1 <= len(before) < 13, sorted(before)
    code, said, err = predict(capsys, *args)
    assert code == 0, err
    line = SUMMARY.match(said[-1])
    assert line is not None and line.group(3, 8) == (str(13 - len(before)), str(len(before))), said
    after = {
        name: ((out / name).read_bytes(), (out / name).stat().st_ino, (out / name).stat().st_mtime_ns)
        for name in before
    }
    assert after == before  # the same bytes in the same file, never written again
    assert_each_key_once(out, uneven)
    assert not list(out.glob(".*.tmp"))


def test_a_folder_of_images(run: Path, tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo tree's val folder, no shards: a row per image file keyed by its path in the folder,
    no label; in JSON lines on request."""
    out = tmp_path / "preds"
    args = [str(run), "--data", str(tree / "val"), "--out", str(out), "--format", "jsonl", "--top-k", "2"]
    code, said, err = predict(capsys, *args)
    assert code == 0, err
    files = sorted(p.relative_to(tree / "val").as_posix() for p in (tree / "val").rglob("*") if p.is_file())
    lines = [json.loads(line) for part in sorted(out.glob("*.jsonl")) for line in part.read_text().splitlines()]
    assert sorted(r["key"] for r in lines) == files and len(files) == 50
    assert all(r["label"] is None and len(r["top_classes"]) == 2 and r["error"] is None for r in lines)
    assert said[-1].startswith(f"raywds: predicted 50 samples (0 errors) in 1 parts into {out} (")


def test_an_undecodable_image_is_a_row_with_its_reason(
    run: Path, uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sample whose JPEG holds no pixel rows: its row has no prediction and says why; the others are
    predicted; the line counts it."""
    shards = shardedit.copy(uneven, tmp_path / "shards")
    broken = shardedit.members(shards / "uneven-train-000003.tar")
    key = broken[3][0].split(".", 1)[0]
    jpeg = dict(broken)[f"{key}.jpg"]
    change = shardedit.replace_member("jpg", shardedit.jpeg_cut_after_scan_header(jpeg), nth=1)
    shardedit.rewrite(shards, "train", 3, change, in_manifest=True)
    out = tmp_path / "preds"
    code, said, err = predict(capsys, str(run), "--data", str(shards), "--out", str(out), "--loader-workers", "1")
    assert code == 0, err
    assert SUMMARY.match(said[-1]).group(1, 2) == (str(ALL_KEYS), "1")  # type: ignore[union-attr]
    read = assert_each_key_once(out, shards)
    bad = [r for r in read if r["error"] is not None]
    assert [r["key"] for r in bad] == [key]
    assert bad[0]["error"].startswith(f"{key}.jpg: ") and bad[0]["label"] is not None
    assert bad[0]["top_classes"] is None and bad[0]["top_probs"] is None and bad[0]["top_names"] is None


def test_a_shard_gone_mid_run_is_one_line_and_the_parts_before_it_stay(
    run: Path, uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], short_backoff: None
) -> None:
    """The last shard in the deal's order is gone: after the reader's retries, one line naming it;
    the parts written before stay, and once it is back a rerun writes it alone."""
    shards = shardedit.copy(uneven, tmp_path / "shards")
    gone = shards / "imagenet-val-000003.tar"
    held = gone.read_bytes()
    gone.unlink()
    out = tmp_path / "preds"
    args = [str(run), "--data", str(shards), "--out", str(out), "--loader-workers", "0"]
    code, said, err = predict(capsys, *args)
    assert code == 1 and len(err) == 1 and err[0].startswith("raywds: error: shard "), err
    assert str(gone) in err[0]
    written = sorted(p.name for p in out.glob("*.parquet"))
    assert "imagenet-val-000003.parquet" not in written and written
    gone.write_bytes(held)
    code, said, err = predict(capsys, *args)
    assert code == 0, err
    assert SUMMARY.match(said[-1]).group(3, 8) == (str(13 - len(written)), str(len(written)))  # type: ignore[union-attr]
    assert_each_key_once(out, shards)


def test_refusals_are_one_line(run: Path, uneven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--top-k past the classes; --out holding another model's predictions (its weights changed),
    or other files; each one line, nothing written."""
    out = tmp_path / "preds"
    args = ["--data", str(uneven), "--out", str(out), "--split", "val", "--loader-workers", "0"]
    assert predict(capsys, str(run), *args, "--top-k", "11")[2] == [
        f"raywds: error: --top-k 11 is more than the 10 classes of checkpoint {run}: give --top-k 10 or less"
    ]
    assert not out.exists()
    assert predict(capsys, str(run), *args)[0] == 0
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    first = next(iter(state["model"]))
    state["model"][first] = state["model"][first] + 1
    other = tmp_path / "other.pt"
    torch.save(state, other)
    code, said, err = predict(capsys, str(other), *args)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"raywds: error: --out {out} holds predictions of checkpoint {run} on {uneven}; ")
    assert f"this predict has another model (checkpoint {other}, weights " in err[0]
    assert err[0].endswith(": give another --out (or remove that one) rather than mix them")
    code, said, err = predict(capsys, str(run), *args, "--top-k", "3")
    assert err == [
        f"raywds: error: --out {out} holds predictions of checkpoint {run} on {uneven}; this predict has --top-k 3 "
        "(the folder's: 5): give another --out (or remove that one) rather than mix them"
    ]
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    assert predict(capsys, str(run), "--data", str(uneven), "--out", str(stray))[2] == [
        f"raywds: error: --out {stray} holds files but no _predictions.json: give an empty or new folder"
    ]
