"""`raywds convert NEWSRC OUT --append`: new shards and a new manifest version; the old shards, their
labels and their bytes unchanged; an interrupted append resumes; the same images twice, an
ambiguous class folder and a folder without a dataset are one line each; a split epoch over the
union trains every sample once."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.data import epoch_keys, tar_keys
from support.runs import small_config

from raywds.cli import main
from raywds.data.append import append
from raywds.data.convert import ConvertOptions, ShardJob, convert, processes
from raywds.data.manifest import read_manifest
from raywds.data.resume import JOURNAL
from raywds.data.verify import verify
from raywds.errors import DataError

OPTIONS = ConvertOptions(maxcount=16, seed=3)


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.tar"))}


def new_images(tree: Path, out: Path) -> Path:
    """12 new images of an existing class (n90000001), 10 train and 4 val of a new class `aaa`,
    which sorts before every class there: copies of the tree's own, under new names."""
    for i, source in enumerate(sorted((tree / "train" / "n90000002").glob("*.JPEG"))[:12]):
        (out / "train" / "n90000001").mkdir(parents=True, exist_ok=True)
        shutil.copy(source, out / "train" / "n90000001" / f"more_{i}.JPEG")
        if i < 10:
            (out / "train" / "aaa").mkdir(parents=True, exist_ok=True)
            shutil.copy(source, out / "train" / "aaa" / f"aaa_{i}.JPEG")
    for i, source in enumerate(sorted((tree / "val" / "n90000003").glob("*.JPEG"))[:4]):
        (out / "val" / "aaa").mkdir(parents=True, exist_ok=True)
        shutil.copy(source, out / "val" / "aaa" / f"aaa_val_{i}.JPEG")
    return out


@pytest.fixture
def dataset(tree: Path, tmp_path: Path) -> Path:
    out = tmp_path / "shards"
    convert(tree, out, OPTIONS)
    return out


def labels(folder: Path, split: str) -> dict[str, int]:
    """Each sample's key -> its .cls, read from the tars."""
    import tarfile

    found = {}
    for path in sorted(folder.glob(f"*-{split}-*.tar")):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".cls"):
                    found[member.name[:-4]] = int(tar.extractfile(member).read())  # type: ignore[union-attr]
    return found


def test_an_append_adds_shards_and_a_version_and_changes_no_old_byte_or_label(
    tree: Path, dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, old_labels = digests(dataset), labels(dataset, "train")
    old = json.loads((dataset / "manifest.json").read_text())
    more = new_images(tree, tmp_path / "more")
    assert main(["convert", str(more), str(dataset), "--append", "--maxcount", "5"]) == 0
    out = capsys.readouterr().out
    assert "appended 22 train samples in 2 new shards, 4 val samples in 1 new shard as version 2" in out
    assert "1 new class after the 10 there: aaa (10)" in out

    after = digests(dataset)
    assert {name: after[name] for name in before} == before, "an old shard changed"
    new = json.loads((dataset / "manifest.json").read_text())
    assert new["classes"] == [*old["classes"], "aaa"], "a new class goes at the end, whatever its name"
    assert new["version"] == 2 and new["maxcount"] == old["maxcount"] == 16, "cut with the dataset's settings"
    train = [s["name"] for s in new["splits"]["train"]["shards"]]
    assert train[: len(old["splits"]["train"]["shards"])] == [s["name"] for s in old["splits"]["train"]["shards"]]
    assert train[-2:] == ["imagenet-train-000008.tar", "imagenet-train-000009.tar"]
    assert new["splits"]["train"]["num_samples"] == 120 + 22 and new["splits"]["val"]["num_samples"] == 50 + 4
    entry = new["appended"][-1]
    assert entry["classes_added"] == ["aaa"] and entry["splits"]["train"]["shards"] == train[-2:]

    now = labels(dataset, "train")
    assert {k: now[k] for k in old_labels} == old_labels
    assert Counter(v for k, v in now.items() if k not in old_labels) == {0: 12, 10: 10}  # n90000001 keeps 0
    count, problems = verify(str(dataset))
    assert problems == [] and count == len(after)
    assert read_manifest(str(dataset)).num_samples("train") == 142  # the columns are the new version's too


def test_the_same_images_twice_a_missing_dataset_and_an_ambiguous_class_are_one_line(
    tree: Path, dataset: Path, tmp_path: Path
) -> None:
    more = new_images(tree, tmp_path / "more")
    append(more, dataset, OPTIONS)
    with pytest.raises(DataError, match=r"were appended to .* already \(version 2\)"):
        append(more, dataset, OPTIONS)
    with pytest.raises(DataError, match=r"holds no manifest.json: convert the first images into it without --append"):
        append(more, tmp_path / "nothing-here", OPTIONS)
    two = tmp_path / "two-cases"
    for name in ("cat", "CAT"):
        (two / "train" / name).mkdir(parents=True)
        shutil.copy(next((tree / "train" / "n90000001").glob("*.JPEG")), two / "train" / name / f"{name}_1.JPEG")
    both = tmp_path / "both"
    convert(two, both, OPTIONS)
    odd = tmp_path / "odd"
    (odd / "train" / "Cat").mkdir(parents=True)
    shutil.copy(next((tree / "train" / "n90000001").glob("*.JPEG")), odd / "train" / "Cat" / "x.JPEG")
    with pytest.raises(DataError, match=r"class folder 'Cat' matches CAT and cat of the dataset ignoring case"):
        append(odd, both, OPTIONS)


class Interrupted(Exception):
    pass


def test_an_interrupted_append_keeps_the_old_manifest_and_its_rerun_writes_no_shard_twice(
    tree: Path, dataset: Path, tmp_path: Path
) -> None:
    more = new_images(tree, tmp_path / "more")
    old_manifest = (dataset / "manifest.json").read_bytes()
    # Shards of 4 samples: the 22 train and 4 val new ones in 7 shards.
    small = json.loads(old_manifest)
    small["maxcount"] = 4
    (dataset / "manifest.json").write_text(json.dumps(small))
    old_manifest = (dataset / "manifest.json").read_bytes()

    def two_then_stop(jobs: list[ShardJob]) -> Iterator[tuple[ShardJob, dict[str, Any]]]:
        for i, done in enumerate(processes(1)(jobs)):
            if i == 2:
                raise Interrupted
            yield done

    with pytest.raises(Interrupted):
        append(more, dataset, OPTIONS, run=two_then_stop)
    assert (dataset / "manifest.json").read_bytes() == old_manifest, "readers see the dataset as it was"
    journalled = [json.loads(line)["shard"]["name"] for line in (dataset / JOURNAL).read_text().splitlines()]
    assert len(journalled) == 2 and not set(journalled) & digests_of(old_manifest)
    written = {name: (dataset / name).stat().st_mtime_ns for name in journalled}

    manifest = append(more, dataset, OPTIONS)
    assert manifest["kept_from_earlier_run"] == 2
    assert {name: (dataset / name).stat().st_mtime_ns for name in written} == written, "a finished shard was rewritten"
    assert len(manifest["appended"][-1]["splits"]["train"]["shards"]) == 6
    assert verify(str(dataset))[1] == []


def digests_of(manifest: bytes) -> set[str]:
    return {s["name"] for info in json.loads(manifest)["splits"].values() for s in info["shards"]}


def test_a_split_epoch_over_the_grown_dataset_trains_every_sample_once(
    tree: Path, dataset: Path, tmp_path: Path
) -> None:
    from raywds.launch.local import run_local

    append(new_images(tree, tmp_path / "more"), dataset, OPTIONS)
    audit = tmp_path / "audit"
    run_local(small_config(dataset, mode="split", epochs=1, audit_dir=str(audit), out=str(tmp_path / "run")))
    trained = epoch_keys(audit, 0, dataset)
    assert trained == Counter(tar_keys(dataset)) and sum(trained.values()) == 142


def test_a_run_resumed_across_an_append_finishes_its_epoch_on_the_old_shards_then_trains_on_all(
    tree: Path, dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopped inside epoch 1, the data grows (new images of the classes there), the run resumes:
    epoch 1 ends exactly on the 120 samples it began with, epoch 2 trains on all 132, each once."""
    import dataclasses
    import logging

    from raywds.launch.local import run_local

    old_keys = Counter(tar_keys(dataset))
    audit, run = tmp_path / "audit", tmp_path / "run"
    cfg = small_config(dataset, mode="split", epochs=2, max_steps=3, audit_dir=str(audit), out=str(run))
    run_local(cfg)
    more = tmp_path / "more" / "train" / "n90000004"
    more.mkdir(parents=True)
    for i, source in enumerate(sorted((tree / "train" / "n90000005").glob("*.JPEG"))):
        more.joinpath(f"again_{i}.JPEG").write_bytes(source.read_bytes())
    append(tmp_path / "more", dataset, OPTIONS)
    with caplog.at_level(logging.INFO, logger="raywds"):
        run_local(dataclasses.replace(cfg, max_steps=None, resume=str(run)))
    said = "the data grew since the checkpoint (an append): 12 training samples in 1 new shard; "
    assert said + "epoch 1 finishes on the shards it began with, epoch 2 trains on all" in caplog.text
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if "epoch_samples" in r and not r.get("inside_epoch")]
    assert [(r["epoch_samples"], r["epoch_duplicates"], r["epoch_missing"]) for r in epochs] == [
        (120, 0, 0),
        (132, 0, 0),
    ]
    assert epoch_keys(audit, 0, dataset) == old_keys
    assert epoch_keys(audit, 1, dataset) == Counter(tar_keys(dataset)) and sum(old_keys.values()) == 120


def test_a_resume_across_an_append_of_new_classes_is_one_line(tree: Path, dataset: Path, tmp_path: Path) -> None:
    import dataclasses

    from raywds.errors import ConfigError
    from raywds.launch.local import run_local

    run = tmp_path / "run"
    cfg = small_config(dataset, mode="split", epochs=2, max_steps=2, out=str(run))
    run_local(cfg)
    append(new_images(tree, tmp_path / "more"), dataset, OPTIONS)
    with pytest.raises(ConfigError, match=r"the data gained 1 class since the checkpoint \(an append: aaa…\)"):
        run_local(dataclasses.replace(cfg, max_steps=None, resume=str(run)))
