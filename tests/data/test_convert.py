"""convert: tree -> shards round trip, read back by tar, plain webdataset and our manifest."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from support.data import same_jpeg_pixels

from raywds.data.convert import ConvertOptions, convert
from raywds.data.manifest import read_manifest
from raywds.errors import ConfigError, DataError


def read_all(shard_dir: Path, split: str) -> list[dict]:
    manifest = read_manifest(str(shard_dir))
    urls = [manifest.url(s) for s in manifest.shards(split)]
    return list(wds.WebDataset(urls, shardshuffle=False))


def source_files(tree: Path, split: str) -> dict[str, Path]:
    return {str(p.relative_to(tree)): p for p in (tree / split).rglob("*.JPEG")}


@pytest.mark.parametrize("split", ["train", "val"])
def test_round_trip_keeps_pixels_classes_and_counts(tree: Path, shards: Path, split: str) -> None:
    samples = read_all(shards, split)
    sources = source_files(tree, split)
    classes = sorted(p.name for p in (tree / "train").iterdir())
    seen = Counter()
    for sample in samples:
        meta = json.loads(sample["json"])
        path = sources[meta["source"]]
        assert same_jpeg_pixels(sample["jpg"], path.read_bytes()), f"{meta['source']} lost pixels or restart markers"
        assert int(sample["cls"]) == classes.index(path.parent.name)
        assert meta["class"] == path.parent.name
        assert (meta["format"], meta["width"], meta["height"]) == ("JPEG", 32, 32)
        seen[meta["source"]] += 1
    assert set(seen) == set(sources), "some source images are missing from the shards"
    assert set(seen.values()) == {1}, "some source images were written twice"


def test_keep_jpeg_bytes_stores_every_byte(tree: Path, tmp_path: Path) -> None:
    manifest = convert(tree, tmp_path / "out", ConvertOptions(maxcount=16, keep_jpeg_bytes=True))
    assert manifest["jpeg_restarts"] is False
    sources = source_files(tree, "train")
    samples = read_all(tmp_path / "out", "train")
    assert samples and all(s["jpg"] == sources[json.loads(s["json"])["source"]].read_bytes() for s in samples)


def test_manifest_matches_the_files(tree: Path, shards: Path) -> None:
    manifest = read_manifest(str(shards))
    assert manifest.classes == sorted(p.name for p in (tree / "train").iterdir())
    assert [s.num_samples for s in manifest.shards("train")] == [16] * 7 + [8]
    assert manifest.num_samples("val") == 50
    for split in ("train", "val"):
        for shard in manifest.shards(split):
            data = (shards / shard.name).read_bytes()
            assert shard.name.startswith(f"imagenet-{split}-") and shard.name.endswith(".tar")
            assert shard.num_bytes == len(data)
            assert shard.sha256 == hashlib.sha256(data).hexdigest()
    assert sorted(p.name for p in shards.glob("*.tar")) == sorted(
        s.name for split in ("train", "val") for s in manifest.shards(split)
    )
    assert not list(shards.glob("*.tmp")) and not list(shards.glob(".*.tmp")), "temporary files left behind"


def test_tar_lists_three_members_per_sample(shards: Path) -> None:
    shard = read_manifest(str(shards)).shards("train")[0]
    names = subprocess.run(
        ["tar", "tf", str(shards / shard.name)], check=True, capture_output=True, text=True
    ).stdout.split()
    keys = Counter(n.split(".", 1)[0] for n in names)
    assert len(keys) == shard.num_samples
    assert all(count == 3 for count in keys.values())
    assert {n.split(".", 1)[1] for n in names} == {"jpg", "cls", "json"}


def test_shuffle_is_seeded_and_mixes_classes(tree: Path, tmp_path: Path) -> None:
    a = convert(tree, tmp_path / "a", ConvertOptions(maxcount=16, seed=3))
    b = convert(tree, tmp_path / "b", ConvertOptions(maxcount=16, seed=3, workers=2))
    c = convert(tree, tmp_path / "c", ConvertOptions(maxcount=16, seed=4))
    assert a["splits"] == b["splits"], "same seed must give byte-identical shards, with 1 or 2 workers"
    assert a["splits"]["train"]["shards"] != c["splits"]["train"]["shards"]
    first = read_all(tmp_path / "a", "train")[:16]
    assert len({int(s["cls"]) for s in first}) >= 5, "the first shard should mix classes"


def test_maxsize_cuts_shards_by_bytes(tree: Path, tmp_path: Path) -> None:
    manifest = convert(tree, tmp_path, ConvertOptions(maxsize=30_000))
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) > 5
    assert all(s["num_bytes"] <= 30_000 for s in shards)
    assert sum(s["num_samples"] for s in shards) == 120


def test_imagefolder_with_png_and_grayscale(tmp_path: Path) -> None:
    src = tmp_path / "folder"
    for name, mode, fmt, ext in [("cats", "L", "JPEG", ".jpg"), ("dogs", "RGB", "PNG", ".png")]:
        (src / name).mkdir(parents=True)
        for i in range(3):
            buf = io.BytesIO()
            Image.fromarray(np.full((8, 10), 40 * i, np.uint8)).convert(mode).save(buf, format=fmt)
            (src / name / f"img{i}{ext}").write_bytes(buf.getvalue())
    (src / "dogs" / "notes.txt").write_text("not an image")
    convert(src, tmp_path / "out", ConvertOptions(maxcount=4))
    samples = read_all(tmp_path / "out", "train")
    assert len(samples) == 6
    for sample in samples:
        meta = json.loads(sample["json"])
        image = sample.get("jpg") or sample.get("png")
        source = (src / meta["source"]).read_bytes()
        assert same_jpeg_pixels(image, source) if meta["format"] == "JPEG" else image == source
        assert (meta["format"], meta["mode"]) == (("JPEG", "L") if meta["class"] == "cats" else ("PNG", "RGB"))


def test_missing_source_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"input directory .*nowhere does not exist"):
        convert(tmp_path / "nowhere", tmp_path / "out")


def test_empty_class_tree_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src" / "train").mkdir(parents=True)
    with pytest.raises(DataError, match="has no class folders"):
        convert(tmp_path / "src", tmp_path / "out")


def write_image(path: Path, fmt: str = "JPEG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 10, 3), 90, np.uint8)).save(path, format=fmt)


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664)])
def test_every_written_file_follows_the_umask(tree: Path, tmp_path: Path, umask: int, mode: int) -> None:
    """A shared shard folder is read by other users and by nginx in Docker: the manifest and
    _info.json were once 0600 (mkstemp) while the shards beside them followed the umask."""
    old = os.umask(umask)
    try:
        convert(tree, tmp_path / "out", ConvertOptions(maxcount=64))
    finally:
        os.umask(old)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "out").iterdir()}
    assert {"manifest.json", "_info.json", "imagenet-train-000000.tar"} <= set(modes)
    assert modes == {name: oct(mode) for name in modes}


def test_empty_class_folder_is_kept_and_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "folder"
    write_image(src / "ants" / "a.jpg")
    (src / "bees").mkdir()
    write_image(src / "cats" / "c.jpg")
    (src / "emus").mkdir()
    (src / "emus" / "notes.txt").write_text("no images yet")
    layout_log = logging.getLogger("raywds.data.layout")  # its own handler: the CLI's console handler stops propagation
    layout_log.addHandler(caplog.handler)
    try:
        manifest = convert(src, tmp_path / "out")
    finally:
        layout_log.removeHandler(caplog.handler)
    assert "2 classes have no train images: bees (index 1), emus (index 3)" in caplog.text
    # the classes stay, so the indices of the others still match ImageFolder's sorted order
    assert manifest["classes"] == ["ants", "bees", "cats", "emus"]
    assert sorted(int(s["cls"]) for s in read_all(tmp_path / "out", "train")) == [0, 2]
    assert manifest["empty_classes"] == {"train": ["bees", "emus"]}
    run = subprocess.run(
        [str(Path(sys.executable).parent / "raywds"), "convert", str(src), str(tmp_path / "cli")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "2 classes have no train images: bees (index 1), emus (index 3)" in run.stdout + run.stderr


@pytest.mark.parametrize(
    ("inside", "overwrite"), [("shards", False), ("shards", True), ("train/n90000001/out", False), (".", True)]
)
def test_output_inside_the_source_is_refused(tree: Path, tmp_path: Path, inside: str, overwrite: bool) -> None:
    """Shards inside SRC are scanned on the next run: as a class of their own, or as images."""
    src = tmp_path / "src"
    shutil.copytree(tree, src)
    out = src / inside
    with pytest.raises(
        ConfigError, match=r"is inside the source tree .*src; choose an output folder outside SRC, e\.g\. .*src-shards"
    ):
        convert(src, out, ConvertOptions(overwrite=overwrite))
    assert sorted(p.name for p in src.iterdir()) == ["train", "val"], "nothing may be written into SRC"


def test_output_beside_the_source_is_fine_whatever_its_name(tree: Path, tmp_path: Path) -> None:
    (tmp_path / "src").symlink_to(tree)
    manifest = convert(tmp_path / "src", tmp_path / "src-shards")  # shares the prefix "src", not the folder
    assert manifest["splits"]["train"]["num_samples"] == 120


@pytest.mark.parametrize("name", ["x.tar; touch {marker} #", "../outside.tar", "/etc/passwd", ".hidden.tar"])
def test_a_manifest_naming_a_shard_by_a_path_or_shell_text_is_refused(shards: Path, tmp_path: Path, name: str) -> None:
    """A manifest read from a server or shared folder cannot run a command through a `pipe:`
    --shards-at template, nor send the reader out of the shard folder."""
    marker = tmp_path / "ran"
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["name"] = name.format(marker=marker)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"names a shard '.*': a shard's name is a plain file name"):
        found = read_manifest(str(tmp_path), shards_at="pipe:cat " + str(shards) + "/{}")
        for shard in found.shards("train")[:1]:
            with wds.WebDataset([found.url(shard)], shardshuffle=False) as dataset:
                list(dataset)
    assert not marker.exists(), "the manifest ran a command"
