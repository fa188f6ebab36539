"""Training on WebDataset shards raywds did not write (tests/support/foreign.py), given to --data as
WebDataset users name them: exact split epochs and a mid-epoch resume, checked by `raywds audit`;
a shard overwritten by another's bytes stops the run with one line naming it."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from support import foreign
from support.runs import small_config

from raywds.cli.main import main
from raywds.data import shardlists
from raywds.data.dataset import manifest_for, write_index
from raywds.data.index import index_shards
from raywds.data.shardlists import split_by_name
from raywds.data.shardoptions import IndexOptions
from raywds.runs.folder import RunDir
from raywds.train.audit import audit, kept, trained
from raywds.train.trainer import train
from raywds.world import World

pytestmark = pytest.mark.slow

NUM_SAMPLES = 40
SIZES = foreign.shard_sizes(NUM_SAMPLES, 12)  # 12, 12, 12, 4


@pytest.fixture(scope="module")
def foreign_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("foreign")
    foreign.shardwriter_shards(out, num_samples=NUM_SAMPLES, maxcount=12, seed=5)
    return out


def brace(folder: Path) -> str:
    return str(folder / f"train-{{0000..{len(SIZES) - 1:04d}}}.tar")


def test_split_epochs_on_foreign_shards_train_every_sample_once(
    foreign_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    audit_dir, cache = tmp_path / "audit", tmp_path / "cache"
    cfg = small_config(brace(foreign_shards), mode="split", epochs=2, audit_dir=str(audit_dir), index_cache=str(cache))
    final = train(cfg, World(), run_dir=RunDir(tmp_path / "run"))
    assert final["samples_seen"] == 2 * NUM_SAMPLES and final["epoch_duplicates"] == 0
    checks = audit(audit_dir, manifest_for(cfg.data, index_cache=str(cache)))
    assert [(c.samples, c.repeated, c.missing, c.first_problem) for c in checks] == [(NUM_SAMPLES, 0, 0, None)] * 2

    monkeypatch.setenv("RAYWDS_INDEX_CACHE", str(cache))  # `raywds audit` has no --index-cache: the same index
    assert main(["audit", str(audit_dir), "--data", cfg.data]) == 0
    out = capsys.readouterr().out
    assert f"epoch 1: {NUM_SAMPLES} samples, each once\nepoch 2: {NUM_SAMPLES} samples, each once\n" in out
    assert f"raywds: 2 epochs in {audit_dir}: every sample exactly once in each" in out
    assert len(list(cache.glob("*/manifest.json"))) == 1


def test_a_mid_epoch_resume_on_foreign_shards_trains_exactly_the_rest(foreign_shards: Path, tmp_path: Path) -> None:
    audit_dir, out = tmp_path / "audit", tmp_path / "run"
    cfg = small_config(
        brace(foreign_shards),
        mode="split",
        batch_size=8,
        epochs=1,
        max_steps=2,
        audit_dir=str(audit_dir),
        out=str(out),
        index_cache=str(tmp_path / "cache"),
    )
    stopped = train(cfg, World(), run_dir=RunDir(out))
    assert stopped["inside_epoch"] and stopped["epoch_samples_done"] == 16
    first = set(trained(kept(audit_dir)[0]).tolist())
    assert len(first) == 16
    before = set(audit_dir.iterdir())

    final = train(dataclasses.replace(cfg, max_steps=None, resume=str(out)), World(), run_dir=RunDir(out, append=True))
    later = trained(sorted(f for f in audit_dir.iterdir() if f not in before))
    assert len(later) == NUM_SAMPLES - 16 and not first & set(later.tolist()), "only what the first run had not seen"
    assert sorted(first | set(later.tolist())) == list(range(NUM_SAMPLES))
    assert final["samples_seen"] == NUM_SAMPLES and final["epoch_duplicates"] == 0
    [check] = audit(audit_dir, manifest_for(cfg.data, index_cache=str(tmp_path / "cache")))
    assert check.first_problem is None and check.samples == NUM_SAMPLES


def failed_run(data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> str:
    """`raywds train --mode split` on `data`, which must fail: its one error line."""
    code = main(
        ["train", "--data", str(data), "--model", "demo", "--epochs", "1", "--batch-size", "16", "--image-size", "28"]
        + ["--loader-workers", "1", "--mode", "split", "--out", str(tmp_path / "run")]
    )
    out, err = capfd.readouterr()
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    assert "samples seen" not in out + err, "no summary of an epoch that was not exact"
    [line] = [line for line in err.splitlines() if line.startswith("raywds: error: ")]
    assert err.rstrip().endswith(line), "the error is the last line"
    return line


def two_train_shards(shards: Path, data: Path, *, same_size: bool) -> tuple[str, str]:
    """(source, victim): two converted train shards of the same sample count (16) and byte size, or
    the short last one (8) and one of another size."""
    shutil.copytree(shards, data)
    names = sorted(p.name for p in data.glob("*-train-*.tar"))
    source, victim = (names[1], names[0]) if same_size else (names[-1], names[0])
    assert ((data / source).stat().st_size == (data / victim).stat().st_size) == same_size
    return source, victim


def test_a_converted_shard_overwritten_by_a_shard_of_another_size_stops_at_open(
    shards: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    source, victim = two_train_shards(shards, data, same_size=False)
    shutil.copy(data / source, data / victim)
    size = (data / victim).stat().st_size
    assert failed_run(data, tmp_path, capfd) == (
        f"raywds: error: shard {data / victim} is {size} bytes, its manifest entry 71680: it changed after the "
        "manifest was made; run `raywds verify` on the run's --data (or `raywds index` again for shards raywds "
        "did not write)"
    )


def test_a_converted_shard_overwritten_by_one_of_the_same_size_fails_its_first_key(
    shards: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Tar records pad two shards of 16 samples to the same size: the size check cannot tell them apart."""
    data = tmp_path / "data"
    source, victim = two_train_shards(shards, data, same_size=True)
    shutil.copy(data / source, data / victim)
    keys = foreign.tar_keys(data / source)
    line = failed_run(data, tmp_path, capfd)
    assert line.startswith(
        f"raywds: error: shard {data / victim}: its first sample is {keys[0]}, its manifest entry's "
    )
    assert "it is another shard's bytes or changed after the manifest was made" in line


def test_an_indexed_shard_overwritten_by_one_of_the_same_size_fails_its_first_key(
    foreign_shards: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    shutil.copytree(foreign_shards, data)
    write_index(index_shards(split_by_name(shardlists.expand([str(data)])), IndexOptions()), None)
    assert (data / "train-0000.tar").stat().st_size == (data / "train-0001.tar").stat().st_size  # 12 samples each
    shutil.copy(data / "train-0001.tar", data / "train-0000.tar")
    assert failed_run(data, tmp_path, capfd) == (
        f"raywds: error: shard {data / 'train-0000.tar'}: its first sample is sample000012, its manifest entry's "
        "sample000000: it is another shard's bytes or changed after the manifest was made; run `raywds verify` "
        "on the run's --data (or `raywds index` again for shards raywds did not write)"
    )


def test_png_shards_with_folder_keys_and_json_class_names_train(tmp_path: Path) -> None:
    shards = tmp_path / "png"
    foreign.png_shards(shards, label="name")
    write_index(index_shards({"train": shardlists.expand([str(shards)])}, IndexOptions(label_field="class")), None)
    audit_dir = tmp_path / "audit"
    cfg = small_config(shards, mode="split", epochs=2, audit_dir=str(audit_dir))
    final = train(cfg, World(), run_dir=RunDir(tmp_path / "run"))
    assert final["samples_seen"] == 2 * 27 and final["epoch_duplicates"] == 0
    assert np.isfinite(final["train_loss"])
    checks = audit(audit_dir, manifest_for(str(shards)))
    assert [c.line for c in checks] == ["epoch 1: 27 samples, each once", "epoch 2: 27 samples, each once"]
