"""`raywds convert NEWSRC OUT --append`: new shards and a new manifest version; the old shards, their
labels and their bytes unchanged; an interrupted append resumes; an image the dataset holds already
(the same folder again after another append, the tree it was converted from, one photo copied into
another class) is refused by its bytes, whatever came between; an ambiguous class folder and a
folder without a dataset are one line each; a split epoch over the union trains every sample once,
and `raywds audit` checks the epochs before the append against the data as it was."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from support.data import epoch_keys, tar_keys
from support.runs import small_config

from raywds.cli.main import main
from raywds.data.append import append
from raywds.data.convert import ConvertOptions, ShardJob, convert, processes
from raywds.data.manifest import read_manifest
from raywds.data.resume import JOURNAL
from raywds.data.verify import verify
from raywds.errors import DataError

OPTIONS = ConvertOptions(maxcount=16, seed=3)


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.tar"))}


def fresh_jpeg(seed: int) -> bytes:
    """A 32 x 32 JPEG of noise that no other seed gives: an image no dataset here holds."""
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def fresh_images(out: Path, counts: dict[str, int], seed: int) -> Path:
    """`counts[SPLIT/CLASS]` new images in each such folder of `out`, none of them the bytes of another."""
    for i, (folder, count) in enumerate(counts.items()):
        (out / folder).mkdir(parents=True, exist_ok=True)
        for k in range(count):
            (out / folder / f"{folder.rsplit('/', 1)[-1]}_{seed}_{k}.JPEG").write_bytes(
                fresh_jpeg(seed * 1000 + i * 100 + k)
            )
    return out


def new_images(tree: Path, out: Path) -> Path:
    """12 new images of an existing class (n90000001), 10 train and 4 val of a new class `aaa`,
    which sorts before every class there."""
    return fresh_images(out, {"train/n90000001": 12, "train/aaa": 10, "val/aaa": 4}, seed=1)


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


def state(folder: Path) -> tuple[bytes, list[str]]:
    """What a refused append must leave as it was: the manifest, and which shards there are."""
    return (folder / "manifest.json").read_bytes(), sorted(p.name for p in folder.glob("*.tar"))


def test_an_image_the_dataset_holds_is_refused_by_its_bytes_whatever_came_between(
    tree: Path, dataset: Path, tmp_path: Path
) -> None:
    """The same folder again after an append that added a class (its listing's fingerprint changed
    with the class list); the very tree the dataset was converted from; one photo of it copied into
    another class folder among new ones: each refused, naming what it repeats, nothing written. A
    folder of new images is taken before and after them."""
    first = fresh_images(tmp_path / "first", {"train/n90000001": 5}, seed=3)
    append(first, dataset, OPTIONS)
    append(fresh_images(tmp_path / "second", {"train/bbb": 4}, seed=4), dataset, OPTIONS)  # a new class
    before = state(dataset)
    with pytest.raises(DataError) as again:
        append(first, dataset, OPTIONS)
    named = "; ".join(
        f"train/n90000001/n90000001_3_{k}.JPEG is train/n90000001/n90000001_3_{k}.JPEG of version 2" for k in range(3)
    )
    assert str(again.value) == (
        f"5 of the 5 images of {first} are in {dataset} already, byte for byte: {named}; …; "
        "append only images that are new: take these out of SRC and run it again (nothing was added)"
    )
    assert state(dataset) == before

    with pytest.raises(
        DataError,
        match=rf"^170 of the 170 images of {tree} are in {dataset} already, byte for byte: "
        r"train/n90000001/n90000001_00000\.JPEG is train/n90000001/n90000001_00000\.JPEG of version 1; ",
    ):
        append(tree, dataset, OPTIONS)
    assert state(dataset) == before

    moved = fresh_images(tmp_path / "moved", {"train/n90000002": 3}, seed=5)
    photo = sorted((tree / "train" / "n90000001").glob("*.JPEG"))[4]
    shutil.copy(photo, moved / "train" / "n90000002" / "copied.JPEG")
    with pytest.raises(DataError) as copied:
        append(moved, dataset, OPTIONS)
    assert str(copied.value) == (
        f"1 of the 4 images of {moved} is in {dataset} already, byte for byte: train/n90000002/copied.JPEG is "
        f"train/n90000001/{photo.name} of version 1; append only images that are new: take it out of SRC and run "
        "it again (nothing was added)"
    )
    assert state(dataset) == before

    manifest = append(fresh_images(tmp_path / "new", {"train/n90000002": 3, "val/bbb": 2}, seed=6), dataset, OPTIONS)
    assert manifest["version"] == 4 and manifest["sources"]["count"] == 170 + 5 + 4 + 5
    with pytest.raises(DataError, match=r"^170 of the 170 images of .* of version 1; "):
        append(tree, dataset, OPTIONS)
    assert verify(str(dataset)) == (len(list(dataset.glob("*.tar"))), [])


def test_the_same_bytes_twice_within_one_conversion_are_both_kept_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ImageNet's own train split holds a photo under two names: a conversion or an append keeps
    both, each a sample, and says so; only an image the dataset held before is refused."""
    src = fresh_images(tmp_path / "src", {"train/a": 3, "train/b": 3}, seed=7)
    shutil.copy(src / "train/a/a_7_0.JPEG", src / "train/b/again.JPEG")
    out = tmp_path / "shards"
    assert main(["convert", str(src), str(out), "--maxcount", "4"]) == 0
    said = "1 image is the bytes of another under a new name (each kept as a sample): "
    assert said + "train/a/a_7_0.JPEG = train/b/again.JPEG" in capsys.readouterr().out.splitlines()
    more = fresh_images(tmp_path / "more", {"train/a": 2}, seed=8)
    shutil.copy(more / "train/a/a_8_1.JPEG", more / "train/a/twice.JPEG")
    assert main(["convert", str(more), str(out), "--append"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["num_samples"] == 7 + 3 and manifest["appended"][-1]["same_bytes"] == 1
    assert manifest["same_bytes"]["count"] == 2


def test_a_dataset_converted_before_raywds_kept_image_hashes_says_how_to_go_on(
    tree: Path, dataset: Path, tmp_path: Path
) -> None:
    old = json.loads((dataset / "manifest.json").read_text())
    del old["sources"]
    (dataset / "manifest.json").write_text(json.dumps(old))
    (dataset / "sources.npz").unlink()
    with pytest.raises(
        DataError,
        match=r"manifest.json keeps no sha256 of its images \(a raywds before sources.npz "
        r"wrote it\), so an append cannot tell which images it holds already: convert its source again",
    ):
        append(new_images(tree, tmp_path / "more"), dataset, OPTIONS)


def test_a_missing_dataset_and_an_ambiguous_class_are_one_line(tree: Path, tmp_path: Path) -> None:
    more = new_images(tree, tmp_path / "more")
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
    first = sources_of(dataset)
    assert first == sorted((path, sha256(tree / path), 1) for path, _, _ in first) and len(first) == 170
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
    lines = [json.loads(line) for line in (dataset / JOURNAL).read_text().splitlines()]
    journalled = [line["shard"]["name"] for line in lines]
    assert len(journalled) == 2 and not set(journalled) & digests_of(old_manifest)
    written = {name: (dataset / name).stat().st_mtime_ns for name in journalled}
    lines[0].pop("sha256s")  # as a raywds that kept no image hashes journalled it: its files are read again
    (dataset / JOURNAL).write_text("".join(json.dumps(line) + "\n" for line in lines))

    manifest = append(more, dataset, OPTIONS)
    assert manifest["kept_from_earlier_run"] == 2
    assert {name: (dataset / name).stat().st_mtime_ns for name in written} == written, "a finished shard was rewritten"
    assert len(manifest["appended"][-1]["splits"]["train"]["shards"]) == 6
    assert verify(str(dataset))[1] == []
    rows = sources_of(dataset)
    assert rows[:170] == first and len(rows) == 170 + 26
    assert rows[170:] == sorted((path, sha256(more / path), 2) for path, _, _ in rows[170:]), "the files' own bytes"
    assert {path for path, _, _ in rows[170:]} == {str(p.relative_to(more)) for p in more.rglob("*.JPEG")}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sources_of(folder: Path) -> list[tuple[str, str, int]]:
    """The dataset's rows of `sources.npz` (path, sha256, version), sorted within each version."""
    with np.load(folder / "sources.npz") as npz:
        paths = npz["paths"].tobytes().decode().split("\0")[:-1]
        rows = [(p, bytes(d).hex(), int(v)) for p, d, v in zip(paths, npz["sha256"], npz["version"])]
    count = json.loads((folder / "manifest.json").read_text())["sources"]["count"]
    return sorted(rows[:count], key=lambda row: (row[2], row[0]))


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
    tree: Path, dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopped inside epoch 1, the data grows (new images of the classes there), the run resumes:
    epoch 1 ends exactly on the 120 samples it began with, epoch 2 trains on all 132, each once;
    `raywds audit` checks epoch 1 against the 120 and says an append came after it."""
    import dataclasses
    import logging

    from raywds.launch.local import run_local

    old_keys = Counter(tar_keys(dataset))
    audit, run = tmp_path / "audit", tmp_path / "run"
    cfg = small_config(dataset, mode="split", epochs=2, max_steps=3, audit_dir=str(audit), out=str(run))
    run_local(cfg)
    append(fresh_images(tmp_path / "more", {"train/n90000004": 12}, seed=2), dataset, OPTIONS)
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
    capsys.readouterr()
    assert main(["audit", str(audit), "--data", str(dataset)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "epoch 1: 120 samples, each once (before an append added 12 samples)",
        "epoch 2: 132 samples, each once",
        f"raywds: 2 epochs in {audit}: every sample exactly once in each",
    ]


def test_a_run_stopped_inside_an_epoch_resumes_across_an_append_of_new_classes(
    tree: Path, dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The classifier grows by the appended class (raywds.models.head), epoch 1 finishes on the
    shards it began with and epoch 2 trains on all of them, each sample once."""
    import dataclasses
    import logging

    import torch

    from raywds.launch.local import run_local

    run = tmp_path / "run"
    cfg = small_config(dataset, mode="split", epochs=2, max_steps=2, out=str(run))
    run_local(cfg)
    append(new_images(tree, tmp_path / "more"), dataset, OPTIONS)
    with caplog.at_level(logging.INFO, logger="raywds"):
        run_local(dataclasses.replace(cfg, max_steps=None, resume=str(run)))
    said = "the data gained 1 class since the checkpoint (aaa): the classifier head.2 grown from 10 to 11 classes"
    assert said in caplog.text
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["classes"][-1] == "aaa" and state["model"]["head.2.weight"].shape[0] == 11
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    assert [(r["epoch_samples"], r["epoch_duplicates"], r["epoch_missing"]) for r in epochs] == [
        (120, 0, 0),
        (142, 0, 0),
    ]
