"""convert on what real ImageNet holds: raw validation layouts, odd and broken files, resume, verify."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from support.data import same_jpeg_pixels

import raywds.data.convert
from raywds.data.convert import JOURNAL, TIMM_INFO, ConvertOptions, convert
from raywds.data.manifest import read_manifest, shardsum
from raywds.data.verify import verify
from raywds.errors import DataError
from raywds.loader.loader import val_loader
from raywds.train.config import TrainConfig
from raywds.world import World

RAYWDS = Path(sys.executable).parent / "raywds"


def flat_val(tree: Path, dest: Path) -> dict[str, str]:
    """Copy the tree into `dest` with val/ flattened to ILSVRC2012_val_N.JPEG; returns stem -> wnid."""
    shutil.copytree(tree / "train", dest / "train")
    (dest / "val").mkdir()
    labels = {}
    for n, path in enumerate(sorted((tree / "val").rglob("*.JPEG")), start=1):
        stem = f"ILSVRC2012_val_{n:08d}"
        shutil.copy(path, dest / "val" / f"{stem}.JPEG")
        labels[stem] = path.parent.name
    return labels


def val_classes(out: Path) -> dict[str, str]:
    manifest = read_manifest(str(out))
    samples = wds.WebDataset([manifest.url(s) for s in manifest.shards("val")], shardshuffle=False)
    return {json.loads(s["json"])["source"]: manifest.classes[int(s["cls"])] for s in samples}


def test_flat_val_with_kaggle_csv(tree: Path, tmp_path: Path) -> None:
    labels = flat_val(tree, tmp_path / "src")
    rows = ["ImageId,PredictionString"] + [f"{stem},{wnid} 10 20 30 40 {wnid} 1 2 3 4" for stem, wnid in labels.items()]
    (tmp_path / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")  # Kaggle puts it beside the tree
    manifest = convert(tmp_path / "src", tmp_path / "out", ConvertOptions(maxcount=20))
    assert manifest["layouts"]["val"] == "flat val, labels from LOC_val_solution.csv"
    assert val_classes(tmp_path / "out") == {f"val/{stem}.JPEG": wnid for stem, wnid in labels.items()}


def test_flat_val_with_devkit_ground_truth_and_wnid_text(tree: Path, tmp_path: Path) -> None:
    labels = flat_val(tree, tmp_path / "src")
    wnids = sorted(set(labels.values()), reverse=True)  # ID order differs from sorted order
    (tmp_path / "wnids.txt").write_text("\n".join(wnids) + "\n")
    truth = "\n".join(str(wnids.index(labels[stem]) + 1) for stem in sorted(labels)) + "\n"
    (tmp_path / "truth.txt").write_text(truth)
    options = ConvertOptions(val_labels=tmp_path / "truth.txt", val_wnids=tmp_path / "wnids.txt")
    manifest = convert(tmp_path / "src", tmp_path / "out", options)
    assert manifest["classes"] == sorted(wnids), "class indices follow sorted wnids, not the devkit's ID order"
    assert val_classes(tmp_path / "out") == {f"val/{stem}.JPEG": wnid for stem, wnid in labels.items()}


def test_flat_val_with_devkit_meta_mat_found_in_place(tree: Path, tmp_path: Path) -> None:
    import scipy.io  # not at collection: every test process would pay for it

    labels = flat_val(tree, tmp_path / "src")
    wnids = sorted(set(labels.values()))[::-1]
    data = tmp_path / "src" / "ILSVRC2012_devkit_t12" / "data"
    data.mkdir(parents=True)
    leaf = [(i + 1, wnid, 0) for i, wnid in enumerate(wnids)]
    parent = [(len(wnids) + 1, "n00001740", 3)]  # a non-leaf synset, as meta.mat has
    synsets = np.array(leaf + parent, dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("num_children", "O")])
    scipy.io.savemat(str(data / "meta.mat"), {"synsets": synsets})
    (data / "ILSVRC2012_validation_ground_truth.txt").write_text(
        "\n".join(str(wnids.index(labels[stem]) + 1) for stem in sorted(labels)) + "\n"
    )
    manifest = convert(tmp_path / "src", tmp_path / "out")
    assert manifest["layouts"]["val"].endswith("ILSVRC2012_validation_ground_truth.txt + meta.mat")
    assert val_classes(tmp_path / "out") == {f"val/{stem}.JPEG": wnid for stem, wnid in labels.items()}


def test_flat_val_without_labels_says_what_to_pass(tree: Path, tmp_path: Path) -> None:
    flat_val(tree, tmp_path / "src")
    with pytest.raises(DataError, match=r"no labels were found; pass --val-labels LOC_val_solution.csv"):
        convert(tmp_path / "src", tmp_path / "out")


def encoded(mode: str, fmt: str, size: tuple[int, int] = (20, 16)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).convert(
        mode
    ).save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture
def odd_tree(tmp_path: Path) -> Path:
    """What ImageNet really holds, plus the rubbish that real folders collect."""
    src = tmp_path / "odd"
    good = src / "train" / "n01"
    good.mkdir(parents=True)
    (good / "rgb.JPEG").write_bytes(encoded("RGB", "JPEG", (400, 300)))
    (good / "gray.JPEG").write_bytes(encoded("L", "JPEG"))
    (good / "cmyk.JPEG").write_bytes(encoded("CMYK", "JPEG"))
    (good / "png_named.JPEG").write_bytes(encoded("RGB", "PNG"))
    (good / "upper.JpG").write_bytes(encoded("RGB", "JPEG"))
    nested = src / "train" / "n02" / "sub"
    nested.mkdir(parents=True)
    (nested / "deep.jpeg").write_bytes(encoded("RGB", "JPEG"))
    bad = src / "train" / "n02"
    (bad / "empty.JPEG").write_bytes(b"")
    (bad / "truncated.JPEG").write_bytes(encoded("RGB", "JPEG", (400, 300))[:-600])
    (bad / "text.JPEG").write_text("<html>not found</html>")
    (good / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (bad / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (src / "train" / "README.txt").write_text("notes")
    return src


def test_odd_images_are_kept_and_broken_ones_skipped_and_listed(odd_tree: Path, tmp_path: Path) -> None:
    manifest = convert(odd_tree, tmp_path / "out", ConvertOptions(maxcount=3))
    assert manifest["splits"]["train"]["num_samples"] == 6
    assert sorted((s["path"], s["reason"].split(" (")[0]) for s in manifest["skipped"]) == [
        ("train/n02/empty.JPEG", "empty file"),
        ("train/n02/text.JPEG", "not a readable image"),
        ("train/n02/truncated.JPEG", "not a readable image"),
    ]
    assert manifest["ignored"]["count"] == 3
    samples = list(
        wds.WebDataset(
            [str(tmp_path / "out" / s["name"]) for s in manifest["splits"]["train"]["shards"]], shardshuffle=False
        )
    )
    meta = {json.loads(s["json"])["source"]: json.loads(s["json"]) for s in samples}
    assert (meta["train/n01/png_named.JPEG"]["format"], meta["train/n01/cmyk.JPEG"]["mode"]) == ("PNG", "CMYK")
    assert meta["train/n01/gray.JPEG"]["mode"] == "L" and meta["train/n02/sub/deep.jpeg"]["class"] == "n02"
    for s in samples:  # JPEGs the region decoder reads: the same pixels, restart markers added; the rest every byte
        source, m = (odd_tree / json.loads(s["json"])["source"]).read_bytes(), json.loads(s["json"])
        if m["format"] == "JPEG" and m["mode"] != "CMYK":
            assert same_jpeg_pixels(s["jpg"], source), m["source"]
        else:
            assert s["jpg"] == source, m["source"]
    # the loader decodes every kept image, whatever its real format, to 3-channel RGB
    shutil.copytree(tmp_path / "out", tmp_path / "as_val")
    m = json.loads((tmp_path / "as_val" / "manifest.json").read_text())
    m["splits"]["val"] = m["splits"]["train"]
    (tmp_path / "as_val" / "manifest.json").write_text(json.dumps(m))
    cfg = TrainConfig(data=str(tmp_path / "as_val"), image_size=16, loader_workers=0)
    images = [batch.images for batch in val_loader(read_manifest(cfg.data), cfg.loader(), World())]
    assert sum(len(x) for x in images) == 6 and all(x.shape[1] == 3 for x in images)


def test_strict_stops_at_the_broken_file_and_names_it(odd_tree: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"n02/(empty|text|truncated)\.JPEG: (empty file|not a readable image)"):
        convert(odd_tree, tmp_path / "out", ConvertOptions(strict=True))


def test_rerun_keeps_finished_shards_and_rewrites_the_rest(tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = convert(tree, out, ConvertOptions(maxcount=16))
    names = [s["name"] for s in first["splits"]["train"]["shards"]]
    # an interrupted run: no manifest yet, one shard never written, one half written
    (out / "manifest.json").unlink()
    (out / names[0]).unlink()
    data = (out / names[1]).read_bytes()
    (out / names[1]).write_bytes(data[: len(data) // 2])
    before = {n: (out / n).stat().st_mtime_ns for n in names[2:]}
    again = convert(tree, out, ConvertOptions(maxcount=16, workers=2))
    assert again["splits"] == first["splits"], "the resumed shards are byte-identical"
    assert again["kept_from_earlier_run"] == len(names) + 4 - 2  # every val shard and all but two train shards
    assert {n: (out / n).stat().st_mtime_ns for n in names[2:]} == before, "finished shards were rewritten"
    assert verify(out) == (len(names) + 4, [])
    assert len((out / JOURNAL).read_text().splitlines()) == len(names) + 4 + 2


def test_other_settings_into_a_used_folder_are_refused(tree: Path, tmp_path: Path) -> None:
    convert(tree, tmp_path / "out", ConvertOptions(maxcount=16, seed=1))
    with pytest.raises(DataError, match="pass --overwrite to replace its shards"):
        convert(tree, tmp_path / "out", ConvertOptions(maxcount=16, seed=2))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty"):
        convert(tree, tmp_path / "other")
    manifest = convert(tree, tmp_path / "out", ConvertOptions(maxcount=40, seed=2, overwrite=True))
    assert sorted(p.name for p in (tmp_path / "out").glob("*.tar")) == sorted(
        s["name"] for split in ("train", "val") for s in manifest["splits"][split]["shards"]
    ), "--overwrite leaves no stale shards behind"


def test_verify_finds_damage_and_the_cli_exits_1(shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "copy"
    shutil.copytree(shards, out)
    assert verify(out) == (12, [])
    name = read_manifest(str(out)).shards("train")[2].name
    data = bytearray((out / name).read_bytes())
    data[700] ^= 0xFF
    (out / name).write_bytes(bytes(data))
    (out / read_manifest(str(out)).shards("val")[0].name).unlink()
    count, problems = verify(out)
    assert problems == [f"{name}: sha256 differs from the manifest", "imagenet-val-000000.tar: missing"]
    run = subprocess.run([str(RAYWDS), "verify", str(out)], capture_output=True, text=True)
    assert run.returncode == 1 and "2 problems in 12 shards" in run.stderr and name in run.stderr


def test_dotted_class_and_shared_stems_give_whole_samples(tmp_path: Path) -> None:
    """webdataset cuts a key at the first dot of the member name: keys once took a dotted class
    name for two files of one stem, so convert wrote samples that verify (and loaders) split."""
    src = tmp_path / "src" / "train"
    for relpath, fmt in [
        ("n0144.v2/a.jpg", "JPEG"),
        ("n0144.v2/a.png", "PNG"),
        ("n0144.v2/b.c.jpg", "JPEG"),
        ("n0144.v2/b_c.jpg", "JPEG"),
        ("n0145/a.jpg", "JPEG"),
        ("n0145/x y+z.JPEG", "JPEG"),
    ]:
        (src / relpath).parent.mkdir(parents=True, exist_ok=True)
        (src / relpath).write_bytes(encoded("RGB", fmt))
    manifest = convert(tmp_path / "src", tmp_path / "out", ConvertOptions(maxcount=4))
    assert verify(tmp_path / "out") == (2, [])
    assert manifest["classes"] == ["n0144.v2", "n0145"], "class names are kept as they are"
    assert json.loads((tmp_path / "out" / TIMM_INFO).read_text())["num_classes"] == 2
    samples = list(
        wds.WebDataset(
            [str(tmp_path / "out" / s["name"]) for s in manifest["splits"]["train"]["shards"]], shardshuffle=False
        )
    )
    sources = {json.loads(s["json"])["source"]: s for s in samples}
    assert sorted(sources) == sorted(f"train/{p.relative_to(src)}" for p in src.rglob("*") if p.is_file())
    for relpath, sample in sources.items():
        assert manifest["classes"][int(sample["cls"])] == relpath.split("/")[1] == json.loads(sample["json"])["class"]
        source = (tmp_path / "src" / relpath).read_bytes()
        assert same_jpeg_pixels(sample["jpg"], source) if "jpg" in sample else sample["png"] == source
        assert "." not in sample["__key__"] and "/" not in sample["__key__"]
    assert len({s["__key__"] for s in samples}) == 6


def test_convert_checks_its_shards_and_names_a_broken_one(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should a key ever hold a dot again, convert stops before the manifest instead of exiting 0."""
    scan = raywds.data.convert.scan

    def scan_with_a_dotted_key(*args: object, **kwargs: object) -> object:
        found = scan(*args, **kwargs)  # type: ignore[arg-type]
        found.splits["train"][0] = dataclasses.replace(found.splits["train"][0], key="broken.key")
        return found

    monkeypatch.setattr(raywds.data.convert, "scan", scan_with_a_dotted_key)
    with pytest.raises(
        DataError,
        match=(
            r"imagenet-train-0000\d\d\.tar as written does not match its manifest entry: .*sample broken has no image"
        ),
    ):
        convert(tree, tmp_path / "out", ConvertOptions(maxcount=16, workers=2))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_shardsum_shows_gaps_as_ranges() -> None:
    names = [f"imagenet-train-{i:06d}.tar" for i in [*range(0, 5), *range(6, 1282)]] + ["imagenet-val-000000.tar"]
    assert shardsum(names[::-1]) == [
        "imagenet-train-{000000..000004}.tar",
        "imagenet-train-{000006..001281}.tar",
        "imagenet-val-000000.tar",
    ]
    run = subprocess.run([str(RAYWDS), "shardsum"], input="\n".join(names[:3]), capture_output=True, text=True)
    assert run.stdout == "imagenet-train-{000000..000002}.tar\n"


def test_timm_info_matches_the_manifest(shards: Path) -> None:
    info = json.loads((shards / TIMM_INFO).read_text())
    manifest = read_manifest(str(shards))
    for split in ("train", "val"):
        entry = info["splits"][split]
        assert entry["name"] == split
        assert entry["filenames"] == [s.name for s in manifest.shards(split)]
        assert entry["shard_lengths"] == [s.num_samples for s in manifest.shards(split)]
        assert entry["num_samples"] == manifest.num_samples(split)


def test_val_class_folders_match_train_ignoring_case(tree: Path, tmp_path: Path) -> None:
    shutil.copytree(tree, tmp_path / "src")
    first = sorted((tmp_path / "src" / "val").iterdir())[0]
    first.rename(first.with_name(first.name.upper()))
    manifest = convert(tmp_path / "src", tmp_path / "out")
    assert manifest["classes"] == sorted(p.name for p in (tree / "train").iterdir())
    assert manifest["splits"]["val"]["num_samples"] == 50


def manifest_samples(shards: Path, split: str) -> list[tuple[str, int]]:
    """(key, label) of every sample of `split` in the manifest's shard order, read with tarfile
    alone: the key as webdataset cuts it (the member's path up to the first dot of its basename),
    the label from `.cls`, which must index the class the sample's `.json` names; each shard
    holds as many samples as the manifest says."""
    manifest = read_manifest(str(shards))
    samples = []
    for shard in manifest.shards(split):
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(shards / shard.name) as tar:
            for member in tar.getmembers():
                folder, slash, base = member.name.rpartition("/")
                stem, _, ext = base.partition(".")
                data = tar.extractfile(member)
                assert data is not None, member.name
                members.setdefault(folder + slash + stem, {})[ext] = data.read()
        assert len(members) == shard.num_samples, shard.name
        for key, files in members.items():
            label = int(files["cls"])
            assert manifest.classes[label] == json.loads(files["json"])["class"], key
            samples.append((key, label))
    assert len(samples) == manifest.num_samples(split)
    return samples


def test_timm_reads_the_same_shards(shards: Path) -> None:
    """What docs/interop.md shows: timm's `wds/` reader finds the shards through `_info.json`."""
    timm_data = pytest.importorskip("timm.data", reason="timm is in the dev extra")
    for split in ("train", "val"):
        expected = manifest_samples(shards, split)
        ordered = timm_data.create_dataset(
            "wds/imagenet", root=str(shards), split=split, is_training=False, batch_size=8
        )
        labels = [int(target) for _, target in ordered]
        keys = [name.removesuffix(".JPEG") for name in ordered.reader.filenames()]  # timm names a sample KEY.JPEG
        assert list(zip(keys, labels, strict=True)) == expected, split
        if split == "train":  # as timm trains: shards and samples shuffled; 120 samples are 15 whole batches
            shuffled = timm_data.create_dataset(
                "wds/imagenet", root=str(shards), split=split, is_training=True, batch_size=8
            )
            labels = [int(target) for _, target in shuffled]
            assert labels != [label for _, label in expected], "timm shuffles what it trains on"
            assert sorted(labels) == sorted(label for _, label in expected)


def test_hugging_face_datasets_reads_the_same_shards(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What docs/interop.md shows: datasets' `webdataset` builder, offline, its cache in tmp_path."""
    for name, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}.items():
        monkeypatch.setenv(name, value)  # read when datasets is imported, just below
    datasets = pytest.importorskip("datasets", reason="datasets is in the dev extra")
    data_files = {split: str(shards / f"imagenet-{split}-*.tar") for split in ("train", "val")}
    loaded = datasets.load_dataset("webdataset", data_files=data_files, cache_dir=str(tmp_path / "hf-cache"))
    assert sorted(loaded) == ["train", "val"]
    manifest = read_manifest(str(shards))
    for split in ("train", "val"):
        expected = manifest_samples(shards, split)
        rows = loaded[split]
        assert list(zip(rows["__key__"], rows["cls"], strict=True)) == expected, split
        assert [Path(url).name for url in rows["__url__"]] == [
            s.name for s in manifest.shards(split) for _ in range(s.num_samples)
        ]
        first = rows[0]
        assert first["json"]["class"] == manifest.classes[first["cls"]]
        assert first["jpg"].size == (first["json"]["width"], first["json"]["height"])


def test_max_side_downscales_large_images_only(odd_tree: Path, tmp_path: Path) -> None:
    manifest = convert(odd_tree, tmp_path / "out", ConvertOptions(max_side=100))
    assert manifest["max_side_px"] == 100
    shard = tmp_path / "out" / manifest["splits"]["train"]["shards"][0]["name"]
    for sample in wds.WebDataset(str(shard), shardshuffle=False):
        meta = json.loads(sample["json"])
        with Image.open(io.BytesIO(sample["jpg"])) as img:
            assert (img.width, img.height, img.format) == (meta["width"], meta["height"], meta["format"])
        if meta["source"] == "train/n01/rgb.JPEG":
            assert meta["resized_from"] == [400, 300] and (meta["width"], meta["height"]) == (100, 75)
        else:
            assert "resized_from" not in meta
            source = (odd_tree / meta["source"]).read_bytes()
            if meta["format"] == "JPEG" and meta["mode"] != "CMYK":
                assert same_jpeg_pixels(sample["jpg"], source), meta["source"]
            else:
                assert sample["jpg"] == source, meta["source"]


def test_a_jpeg_libjpeg_finds_corrupt_is_skipped_unless_its_bytes_are_kept(tmp_path: Path) -> None:
    """A marker in the middle of the entropy data: PIL's 1/8-scale look lets it through, libjpeg's
    full read while adding restart markers does not (the region decoder would refuse it in training)."""
    good = encoded("RGB", "JPEG", (400, 300))
    scan = good.index(b"\xff\xda")
    for name, data in (("good.JPEG", good), ("damaged.JPEG", good[: scan + 40] + b"\xff\xd3" + good[scan + 40 :])):
        (tmp_path / "src" / "train" / "n01").mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / "train" / "n01" / name).write_bytes(data)
    manifest = convert(tmp_path / "src", tmp_path / "out", ConvertOptions())
    assert manifest["splits"]["train"]["num_samples"] == 1
    assert [(s["path"], s["reason"].split(":")[0]) for s in manifest["skipped"]] == [
        ("train/n01/damaged.JPEG", "not a readable image (corrupt JPEG data")
    ]
    kept = convert(tmp_path / "src", tmp_path / "kept", ConvertOptions(keep_jpeg_bytes=True))
    assert kept["splits"]["train"]["num_samples"] == 2 and kept["skipped"] == []
