"""`raywds index` and --data on WebDataset shards raywds did not write (tests/support/foreign.py):
what the manifest records for each layout, the ways of naming shards, over a real HTTP server and
a real S3 server, the cache behind --data, and every bad input as one line or a counted skip."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from support import foreign
from support.s3server import S3Server

from raywds.data import shardlists, stores
from raywds.data.dataset import cache_dir, manifest_for, names_shards, write_index
from raywds.data.demo import make_image
from raywds.data.http import ReadPolicy
from raywds.data.index import index_shards
from raywds.data.manifest import read_manifest, split_location
from raywds.data.members import IMAGE_KEYS, LABEL_KEYS
from raywds.data.shardlists import common_base, split_by_name
from raywds.data.shardoptions import IndexOptions
from raywds.data.stores import Storage
from raywds.errors import DataError

RAYWDS = str(Path(sys.executable).with_name("raywds"))


def index(*specs: str, **options: object) -> dict:
    """The manifest `raywds index SPECS` makes (splits by name), not written anywhere."""
    return index_shards(split_by_name(shardlists.expand(list(specs))), IndexOptions(**options))  # type: ignore[arg-type]


def shard_table(manifest: dict, split: str = "train") -> list[tuple[str, int, int]]:
    return [(s["name"], s["num_samples"], s["num_bytes"]) for s in manifest["splits"][split]["shards"]]


@pytest.fixture(scope="module")
def wds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 samples by webdataset's ShardWriter in train-0000.tar … train-0003.tar (8, 8, 8, 6)."""
    out = tmp_path_factory.mktemp("wds")
    foreign.shardwriter_shards(out, num_samples=30, maxcount=8)
    return out


# --- What the index records, layout by layout ---------------------------------------------------


def test_shardwriter_shards_index_with_counts_classes_members_first_keys_and_sizes(wds_dir: Path) -> None:
    manifest = index(str(wds_dir / "train-{0000..0003}.tar"))
    assert manifest["format"] == "raywds-shards/1" and list(manifest["splits"]) == ["train"]
    train = manifest["splits"]["train"]
    assert train["num_samples"] == 30
    names = [f"train-{i:04d}.tar" for i in range(4)]
    assert shard_table(manifest) == [
        (name, n, (wds_dir / name).stat().st_size) for name, n in zip(names, foreign.shard_sizes(30, 8))
    ]
    assert [s["num_samples"] for s in train["shards"]] == [8, 8, 8, 6]
    assert train["first_keys"] == {name: foreign.tar_keys(wds_dir / name)[0] for name in names}
    assert train["first_keys"]["train-0003.tar"] == "sample000024"
    assert all(s["sha256"] == "" for s in train["shards"])  # local shards are walked, not hashed
    assert set(train["stamps"].values()) == {f"mtime:{(wds_dir / n).stat().st_mtime_ns}" for n in names}
    assert manifest["classes"] == ["0", "1", "2", "3", "4"]  # cls 0..4: 0..K-1
    assert manifest["members"] == {
        "image": list(IMAGE_KEYS),
        "label": "",
        "label_keys": list(LABEL_KEYS),
        "label_field": None,
        "label_names": False,
        "drop_incomplete": True,
    }
    assert manifest["shards_at"] == str(wds_dir) and manifest["skipped"] == [] and manifest["bad_shards"] == []


def test_png_shards_with_folder_keys_and_json_labels_by_class_name(tmp_path: Path) -> None:
    names = foreign.png_shards(tmp_path, label="name")
    manifest = index(str(tmp_path / "part-{000..002}.tar"), label_field="class")
    assert manifest["classes"] == foreign.CLASS_NAMES  # the names found, sorted
    assert manifest["members"]["label"] == "json" and manifest["members"]["label_field"] == "class"
    assert manifest["members"]["label_names"] is True
    assert [n for _, n, _ in shard_table(manifest)] == [10, 10, 7]
    assert (
        manifest["splits"]["train"]["first_keys"]
        == {name: foreign.tar_keys(tmp_path / name)[0] for name in names}
        == {"part-000.tar": "disc/img00000", "part-001.tar": "disc/img00010", "part-002.tar": "disc/img00020"}
    )

    read = read_manifest(write_index(manifest, None))
    assert read.members.label_names and read.classes == foreign.CLASS_NAMES
    assert read.first_keys["part-001.tar"] == "disc/img00010"
    assert read.url(next(s for s in read.shards("train") if s.name == "part-001.tar")) == str(tmp_path / "part-001.tar")


def test_png_shards_with_json_labels_by_integer_field(tmp_path: Path) -> None:
    foreign.png_shards(tmp_path, label="index")
    manifest = index(str(tmp_path), label_field="label")
    assert manifest["classes"] == ["0", "1", "2", "3", "4"] and manifest["members"]["label_names"] is False
    assert manifest["splits"]["train"]["num_samples"] == 27


def test_the_hubs_imagenet_wds_layout_splits_by_name_and_takes_info_json(tmp_path: Path) -> None:
    info = foreign.imagenet_wds(tmp_path)
    manifest = index(str(tmp_path / "imagenet1k-{train-{0000..0003},validation-{00..01}}.tar"))
    assert {split: v["num_samples"] for split, v in manifest["splits"].items()} == {"train": 32, "val": 10}
    for split, hub in (("train", "train"), ("val", "validation")):
        assert [s["name"] for s in manifest["splits"][split]["shards"]] == info["splits"][hub]["filenames"]
        assert [s["num_samples"] for s in manifest["splits"][split]["shards"]] == info["splits"][hub]["shard_lengths"]
    assert manifest["classes"] == [str(i) for i in range(foreign.HUB_NUM_CLASSES)]  # _info.json's 8, not the 5 used
    assert manifest["splits"]["val"]["first_keys"]["imagenet1k-validation-01.tar"] == "ILSVRC2012_val_00000006"
    assert manifest["members"]["label_keys"][0] == "cls"  # cls before json


def test_info_json_counts_that_disagree_write_no_manifest(tmp_path: Path) -> None:
    info = foreign.imagenet_wds(tmp_path)
    info["splits"]["train"]["shard_lengths"][2] = 10
    (tmp_path / "_info.json").write_text(json.dumps(info))
    with pytest.raises(
        DataError,
        match=r"^1 shards disagree with _info.json: _info.json says imagenet1k-train-0002.tar holds 10 samples; "
        r"it holds 9; is _info.json stale\?$",
    ):
        index(str(tmp_path))


def test_local_indexing_reads_a_small_fraction_of_the_shards(tmp_path: Path) -> None:
    """Photos of ImageNet's size (~100 KB): headers and labels only, under 5% of the bytes (webdataset's
    PAX headers are 1,536 bytes a member)."""
    photo = make_image(3, np.random.default_rng(0), 480)
    assert len(photo) > 20_000
    foreign.shardwriter_shards(tmp_path, num_samples=24, maxcount=12, image=photo)
    made = index(str(tmp_path))["made_by"]
    assert made["bytes_in_shards"] == sum(p.stat().st_size for p in tmp_path.glob("*.tar"))
    assert 0 < made["bytes_read"] < 0.05 * made["bytes_in_shards"], made


# --- Naming shards: brace lists, globs, folders, pipe: templates -------------------------------------


def test_brace_glob_folder_and_pipe_template_give_the_same_shards(wds_dir: Path) -> None:
    specs = [
        str(wds_dir / "train-{0000..0003}.tar"),
        str(wds_dir / "train-*.tar"),
        str(wds_dir),
        f"file://{wds_dir}/train-{{0000..0003}}.tar",
        f"pipe:cat {wds_dir}/train-{{0000..0003}}.tar",
    ]
    made = [index(spec) for spec in specs]
    assert all(shard_table(m) == shard_table(made[0]) for m in made), [shard_table(m) for m in made]
    assert all(m["splits"]["train"]["first_keys"] == made[0]["splits"]["train"]["first_keys"] for m in made)
    assert made[4]["shards_at"] == f"pipe:cat {wds_dir}/{{}}"
    piped = made[4]["splits"]["train"]["shards"][0]
    assert piped["sha256"] == hashlib.sha256((wds_dir / "train-0000.tar").read_bytes()).hexdigest()
    assert all(names_shards(spec) for spec in specs if spec != str(wds_dir)) and not names_shards(str(wds_dir))


def test_split_by_name_sorts_train_val_and_validation() -> None:
    urls = [
        "s/imagenet1k-train-0000.tar",
        "s/imagenet1k-validation-00.tar",
        "s/x-val-0.tar",
        "s/val_000.tar",
        "s/other-0.tar",
        "s/test-0.tar",
        "s/trainval-0.tar",
    ]
    assert split_by_name(urls) == {
        "train": ["s/imagenet1k-train-0000.tar", "s/other-0.tar", "s/trainval-0.tar"],
        "val": ["s/imagenet1k-validation-00.tar", "s/x-val-0.tar", "s/val_000.tar", "s/test-0.tar"],
    }


def test_a_spec_naming_no_shard_and_shards_in_no_common_folder_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"train-\{0..3\}.tar\*: names no shard \(no .tar file there\); check the path"):
        shardlists.expand([str(tmp_path / "train-{0..3}.tar*")])
    with pytest.raises(DataError, match=r"^shards a.tar … share no folder: index them in groups, one folder each$"):
        common_base(["a.tar", "b.tar"])


# --- Over HTTP: a plain `python -m http.server` ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def http_wds(wds_dir: Path) -> Iterator[str]:
    """`python -m http.server` serving wds_dir on 127.0.0.1 (stopped by its PID): its base URL."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(wds_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"http.server on port {port} did not start (exit {server.poll()})") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.kill(server.pid, 15)
        server.wait(timeout=10)


def test_index_over_http_streams_and_records_each_shards_sha256(http_wds: str, wds_dir: Path, tmp_path: Path) -> None:
    manifest = index(f"{http_wds}/train-{{0000..0003}}.tar")
    assert manifest["shards_at"] == http_wds
    assert shard_table(manifest) == shard_table(index(str(wds_dir)))
    for shard in manifest["splits"]["train"]["shards"]:
        assert shard["sha256"] == hashlib.sha256((wds_dir / shard["name"]).read_bytes()).hexdigest()
    made = manifest["made_by"]
    assert made["bytes_read"] == made["bytes_in_shards"]  # streamed whole, to hash it

    with pytest.raises(
        DataError,
        match=rf"^shards at {http_wds} cannot have a manifest beside them: give --out DIR \(a folder or bucket\)$",
    ):
        write_index(manifest, None)
    where = write_index(manifest, str(tmp_path / "out"))
    assert json.loads(Path(where).read_text())["shards_at"] == http_wds
    read = read_manifest(str(tmp_path / "out"))
    assert read.url(read.shards("train")[0]) == f"{http_wds}/train-0000.tar"


def test_a_glob_over_http_is_refused_in_one_line(http_wds: str) -> None:
    with pytest.raises(DataError, match=r"train-\*.tar: a glob needs a folder or a bucket to list; over http name"):
        shardlists.expand([f"{http_wds}/train-*.tar"])


# --- Over S3: SeaweedFS -----------------------------------------------------------------------------


def test_index_an_s3_prefix_writes_the_manifest_beside_the_shards_in_the_bucket(s3: S3Server, wds_dir: Path) -> None:
    client = s3.client()
    for path in sorted(wds_dir.glob("*.tar")):
        client.upload_file(str(path), s3.bucket, f"ds/{path.name}")
    client.put_object(Bucket=s3.bucket, Key="ds/README.txt", Body=b"not a shard")
    urls = shardlists.expand([s3.url("ds/")], Storage(s3.endpoint))
    assert urls == [s3.url(f"ds/train-{i:04d}.tar") for i in range(4)]
    manifest = index_shards({"train": urls}, IndexOptions(), policy=ReadPolicy(s3_endpoint=s3.endpoint))
    assert manifest["shards_at"] == s3.url("ds")
    for shard in manifest["splits"]["train"]["shards"]:
        assert shard["sha256"] == hashlib.sha256((wds_dir / shard["name"]).read_bytes()).hexdigest()
    assert all(stamp for stamp in manifest["splits"]["train"]["stamps"].values())  # ETags

    where = write_index(manifest, None, Storage(s3.endpoint))
    assert where == s3.url("ds/manifest.json")
    written = json.loads(client.get_object(Bucket=s3.bucket, Key="ds/manifest.json")["Body"].read())
    assert "shards_at" not in written  # beside the shards
    read = read_manifest(s3.url("ds"), storage=Storage(s3.endpoint))
    assert read.base == s3.url("ds") and read.num_samples("train") == 30 and read.classes == ["0", "1", "2", "3", "4"]
    assert read.first_keys["train-0002.tar"] == "sample000016"
    assert read.url(read.shards("train")[2]) == s3.url("ds/train-0002.tar")


def test_every_s3_object_an_index_reads_is_read_at_the_endpoint_it_was_given(
    s3: S3Server, wds_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --s3-endpoint (not AWS_ENDPOINT_URL, here a port nothing listens on), the shards, the
    manifest's place and a --classes file in the bucket are all read at that endpoint: the classes
    file was read at AWS_ENDPOINT_URL's, else AWS, whatever the endpoint given."""
    client = s3.client()
    for path in sorted(wds_dir.glob("*.tar")):
        client.upload_file(str(path), s3.bucket, f"ds/{path.name}")
    client.put_object(Bucket=s3.bucket, Key="classes.txt", Body=b"zero\none\ntwo\nthree\nfour\n")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: refused at once
    storage = Storage(s3.endpoint)
    urls = shardlists.expand([s3.url("ds/")], storage)
    options = IndexOptions(classes=s3.url("classes.txt"))
    manifest = index_shards({"train": urls}, options, policy=storage.read_policy())
    assert manifest["classes"] == ["zero", "one", "two", "three", "four"]
    assert write_index(manifest, None, storage) == s3.url("ds/manifest.json")
    assert read_manifest(s3.url("ds"), storage=storage).classes == ["zero", "one", "two", "three", "four"]


# --- Where the manifest goes: beside the shards, else --out -----------------------------------------


def read_only_prefix(folder: Path) -> list[str] | None:
    """A command prefix under which `folder` is read-only even to root (a private mount namespace
    with a read-only bind mount of it), or None where that cannot be made."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return [] if not os.access(folder, os.W_OK) else None
    if shutil.which("unshare") is None:
        return None
    mount = f'mount --bind {folder} {folder} && mount -o remount,ro,bind {folder} {folder} && exec "$@"'
    prefix = ["unshare", "-m", "sh", "-c", mount, "sh"]
    probe = subprocess.run([*prefix, "test", "!", "-w", str(folder)], capture_output=True, check=False)
    return prefix if probe.returncode == 0 else None


def test_a_read_only_shard_folder_needs_out_and_the_manifest_there_says_where_the_shards_are(
    wds_dir: Path, tmp_path: Path
) -> None:
    shards = tmp_path / "shards"
    shutil.copytree(wds_dir, shards)
    prefix = read_only_prefix(shards)
    if prefix is None:
        pytest.skip("cannot make a folder read-only here (root ignores chmod, and no unshare -m with mount)")
    try:
        refused = subprocess.run([*prefix, RAYWDS, "index", str(shards)], capture_output=True, text=True, check=False)
        assert refused.returncode == 1, refused.stderr
        assert refused.stderr.strip().splitlines()[-1] == (
            f"raywds: error: {shards} is read-only: give --out DIR for the manifest (it records where the shards are)"
        )
        assert not (shards / "manifest.json").exists()
        out = tmp_path / "index"
        done = subprocess.run(
            [*prefix, RAYWDS, "index", str(shards), "--out", str(out)], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
    finally:
        shards.chmod(0o755)
    assert f"raywds: wrote {out / 'manifest.json'} (5 classes; read " in done.stdout
    assert "train: 30 samples in 4 shards" in done.stdout
    assert json.loads((out / "manifest.json").read_text())["shards_at"] == str(shards)
    read = read_manifest(str(out))
    assert read.url(read.shards("train")[3]) == str(shards / "train-0003.tar")


def test_a_manifest_beside_the_shards_has_no_shards_at(wds_dir: Path, tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shutil.copytree(wds_dir, shards)
    where = write_index(index(str(shards)), None)
    assert where == str(shards / "manifest.json") and "shards_at" not in json.loads(Path(where).read_text())
    assert (shards / "manifest.npz").is_file()
    assert read_manifest(str(shards)).num_samples("train") == 30


# --- Bad input: a counted skip, or one line -----------------------------------------------------


def jpeg() -> bytes:
    return make_image(0, np.random.default_rng(9), 32)


def test_samples_without_image_or_label_are_skipped_and_counted(tmp_path: Path) -> None:
    shard = foreign.write_tar(
        tmp_path / "mixed-0.tar",
        [
            ("a.jpg", jpeg()),
            ("a.cls", b"1"),
            ("b.cls", b"2"),
            ("c.jpg", jpeg()),
            ("c.txt", b"a caption"),
            ("d.jpg", jpeg()),
            ("d.cls", b"0"),
        ],
    )
    manifest = index(str(shard))
    assert manifest["splits"]["train"]["num_samples"] == 2 and manifest["splits"]["train"]["first_keys"] == {
        "mixed-0.tar": "a"
    }
    assert manifest["skipped"] == [
        f"shard {shard}: sample b: no image member (found cls)",
        f"shard {shard}: sample c: no label member (cls or label or target or class or index; found jpg, txt)",
    ]
    strict = rf"^shard {shard}: sample b: no image member \(found cls\) \(--strict\)$"
    with pytest.raises(DataError, match=strict):
        index(str(shard), strict=True)
    with pytest.raises(DataError, match=strict):  # --strict stops the index: the shard is not merely left out
        index(str(shard), strict=True, skip_bad_shards=True)


def test_a_shard_with_no_usable_sample_says_which_flags_to_give(tmp_path: Path) -> None:
    shard = foreign.write_tar(tmp_path / "x-0.tar", [("a.jpg", jpeg()), ("a.txt", b"caption")])
    with pytest.raises(
        DataError,
        match=rf"^1 of 1 shards cannot be indexed; no manifest written \(--skip-bad-shards leaves them out\):\n"
        rf"  shard {shard}: holds no sample with an image and a label \(sample a: no label member .*\); "
        r"say which members hold them with --image-key, --label-key or --label-field \(then `raywds index`\)$",
    ):
        index(str(shard))


def test_two_image_members_need_image_key(tmp_path: Path) -> None:
    png = foreign.png(jpeg())
    shard = foreign.write_tar(tmp_path / "two-0.tar", [("a.jpg", jpeg()), ("a.png", png), ("a.cls", b"0")])
    with pytest.raises(
        DataError, match=rf"  shard {shard}: sample a has 2 image members \(jpg, png\): choose one with --image-key$"
    ):
        index(str(shard))
    manifest = index(str(shard), image_key="png")
    assert manifest["members"]["image"] == ["png"] and manifest["splits"]["train"]["num_samples"] == 1


@pytest.mark.parametrize("cut", ["mid-member", "member boundary"])
@pytest.mark.parametrize("how", ["local", "pipe"])
def test_a_truncated_shard_writes_no_manifest_unless_skipped(wds_dir: Path, tmp_path: Path, cut: str, how: str) -> None:
    for path in wds_dir.glob("*.tar"):
        shutil.copy(path, tmp_path / path.name)
    victim = tmp_path / "train-0001.tar"
    ends = foreign.member_ends(victim)
    data = victim.read_bytes()
    victim.write_bytes(data[: ends[-1] - 700] if cut == "mid-member" else data[: ends[-1]])
    spec = str(tmp_path / "train-{0000..0003}.tar")
    spec = f"pipe:cat {spec}" if how == "pipe" else spec
    url = f"pipe:cat {victim}" if how == "pipe" else str(victim)
    with pytest.raises(
        DataError,
        match=r"^1 of 4 shards cannot be indexed; no manifest written \(--skip-bad-shards leaves them out\):\n"
        rf"  shard {url}: cannot read it as a tar \(.*\); a truncated or damaged shard$",
    ):
        index(spec)
    manifest = index(spec, skip_bad_shards=True)
    assert [name for name, _, _ in shard_table(manifest)] == ["train-0000.tar", "train-0002.tar", "train-0003.tar"]
    assert manifest["splits"]["train"]["num_samples"] == 22
    assert len(manifest["bad_shards"]) == 1 and manifest["bad_shards"][0].startswith(f"shard {url}: cannot read it")


def test_a_missing_shard_is_named(wds_dir: Path) -> None:
    with pytest.raises(DataError, match=rf"  shard {wds_dir}/train-0009.tar: no such file or object$"):
        index(str(wds_dir / "train-{0003,0009}.tar"))


@pytest.mark.parametrize(
    ("text", "made"),
    [
        ('{"foo": 1}', "None"),  # no `splits`: a KeyError traceback before
        ("[1, 2]", "'list'"),
        ('{"format": "other/2", "splits": {}}', "'other/2'"),
    ],
)
def test_a_manifest_json_another_tool_wrote_is_not_a_raywds_manifest(tmp_path: Path, text: str, made: str) -> None:
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(
        DataError,
        match=rf"^{tmp_path}/manifest.json is not a raywds manifest \(format {made}, expected 'raywds-shards/1'\): "
        r"another tool wrote it; `raywds index SHARDS --out DIR` writes one",
    ):
        read_manifest(str(tmp_path))


def test_an_unknown_scheme_is_one_line_naming_the_schemes_raywds_reads(tmp_path: Path) -> None:
    line = (
        r"^ftp://x/y.tar: raywds does not read ftp:// locations; it reads local paths, file://, http\(s\)://, "
        r"s3://, gs:// and pipe: commands$"
    )
    with pytest.raises(DataError, match=line):
        shardlists.expand(["ftp://x/y.tar"])
    with pytest.raises(DataError, match=line):
        manifest_for("ftp://x/y.tar", index_cache=str(tmp_path))
    with pytest.raises(DataError, match=line.replace("y.tar", "y")):
        read_manifest("ftp://x/y")
    assert not list(tmp_path.iterdir())


def test_gs_locations_are_never_local_paths() -> None:
    assert split_location("gs://b/x") == ("gs://b/x", "gs://b/x/manifest.json")
    assert split_location("gs://b/x/manifest.json") == ("gs://b/x", "gs://b/x/manifest.json")
    assert stores.scheme("gs://b/x") == "gs" and stores.join("gs://b/x", "a.tar") == "gs://b/x/a.tar"
    assert common_base(["gs://b/x/train-0.tar", "gs://b/x/train-1.tar"]) == ("gs://b/x", ["train-0.tar", "train-1.tar"])
    assert names_shards("gs://b/x/train-{0..9}.tar") and not names_shards("gs://b/x")


# --- --data: indexed once into the cache, again when a shard changes --------------------------------


def test_manifest_for_indexes_once_and_again_when_a_shard_changes(
    wds_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shards, cache = tmp_path / "shards", tmp_path / "cache"
    shutil.copytree(wds_dir, shards)
    data = str(shards / "train-{0000..0003}.tar")
    first = manifest_for(data, index_cache=str(cache))
    [made] = list(cache.glob("*/manifest.json"))
    assert first.num_samples("train") == 30 and first.base == str(shards)
    assert json.loads(made.read_text())["indexed_from"]["data"] == data
    before = made.stat().st_mtime_ns

    second = manifest_for(data, index_cache=str(cache))
    assert made.stat().st_mtime_ns == before, "reused, not indexed again"
    assert [(s.name, s.num_samples) for s in second.shards("train")] == [
        (s.name, s.num_samples) for s in first.shards("train")
    ]
    assert cache_dir(str(cache)) == cache

    shutil.copy(shards / "train-0003.tar", shards / "train-0001.tar")  # another size: 6 samples, not 8
    logger = logging.getLogger("raywds.data.dataset")
    logger.addHandler(caplog.handler)  # the raywds logger does not propagate (raywds.console)
    try:
        with caplog.at_level(logging.WARNING, logger="raywds.data.dataset"):
            third = manifest_for(data, index_cache=str(cache))
    finally:
        logger.removeHandler(caplog.handler)
    assert (
        f"1 shards changed since they were indexed ({shards / 'train-0001.tar'}): indexing {data} again" in caplog.text
    )
    assert made.stat().st_mtime_ns != before
    assert [s.num_samples for s in third.shards("train")] == [8, 6, 8, 6]
    assert list(cache.glob("*/manifest.json")) == [made]


def test_manifest_for_a_folder_of_shards_without_a_manifest_indexes_it(wds_dir: Path, tmp_path: Path) -> None:
    manifest = manifest_for(str(wds_dir), index_cache=str(tmp_path))
    assert manifest.num_samples("train") == 30 and not (wds_dir / "manifest.json").exists()
    with pytest.raises(DataError, match=rf"^no manifest at {tmp_path}/empty/manifest.json: run `raywds convert"):
        manifest_for(str(tmp_path / "empty"), index_cache=str(tmp_path))


def test_manifest_for_with_val_data_takes_both_lists(tmp_path: Path) -> None:
    foreign.imagenet_wds(tmp_path / "hub")
    manifest = manifest_for(
        str(tmp_path / "hub/imagenet1k-train-{0000..0003}.tar"),
        val_data=str(tmp_path / "hub/imagenet1k-validation-*.tar"),
        index_cache=str(tmp_path / "cache"),
    )
    assert manifest.num_samples("train") == 32 and manifest.num_samples("val") == 10
    assert len(manifest.classes) == foreign.HUB_NUM_CLASSES


# --- raywds verify on what raywds index wrote ------------------------------------------------------


def test_verify_checks_indexed_shards_by_what_the_index_recorded(tmp_path: Path) -> None:
    """Shards of one size that only their keys tell apart, with JSON-free `.cls` labels: `raywds
    verify` passes them as indexed, and names the shard once one is overwritten by the other's
    bytes (same size, same count: only the first key differs); a sample without its label is
    passed over as the index did, not reported as a missing .cls."""
    from raywds.data.verify import verify

    names = foreign.equal_size_shards(tmp_path / "same")
    foreign.write_tar(
        tmp_path / "same" / "same-0002.tar",
        [("a.jpg", jpeg()), ("a.cls", b"1"), ("b.jpg", jpeg()), ("c.jpg", jpeg()), ("c.cls", b"0")],
    )
    manifest = index(str(tmp_path / "same" / "same-{0000..0002}.tar"))
    assert manifest["skipped"] == [
        f"shard {tmp_path / 'same' / 'same-0002.tar'}: sample b: no label member "
        "(cls or label or target or class or index; found jpg)"
    ]
    write_index(manifest, None)
    assert verify(tmp_path / "same") == (3, [])
    shutil.copy(tmp_path / "same" / names[1], tmp_path / "same" / names[0])
    count, problems = verify(tmp_path / "same")
    assert count == 3 and problems == [f"{names[0]}: first sample k00016, manifest says k00000"], problems


def test_a_worker_on_another_node_takes_the_drivers_index_and_reads_no_shard(wds_dir: Path, tmp_path: Path) -> None:
    """`raywds ray`: the driver indexes --data and hands the manifest to the workers, so a node
    with an empty cache neither indexes the shards again nor asks the store about each one. Here
    the shards are gone by the time the worker reads its manifest: it still gets the driver's."""
    from raywds.data.dataset import index_of, manifest_of
    from raywds.train.config import TrainConfig

    data = tmp_path / "shards"
    shutil.copytree(wds_dir, data)
    driver = TrainConfig(data=f"{data}/train-{{0000..0003}}.tar", index_cache=str(tmp_path / "head"))
    assert index_of(driver) is None, "nothing indexed yet"
    indexed = manifest_of(driver)
    text = index_of(driver)
    assert text is not None and json.loads(text)["splits"]["train"]["num_samples"] == 30
    shutil.rmtree(data)
    worker = TrainConfig(data=driver.data, index_cache=str(tmp_path / "other-node"))
    with pytest.raises(DataError, match=r"^4 of 4 shards cannot be indexed"):
        manifest_of(worker)  # on its own it would read every shard again
    got = manifest_of(worker, trusted=text)
    assert list(got.shards("train")) == list(indexed.shards("train")) and got.first_keys == indexed.first_keys
    assert index_of(TrainConfig(data=str(wds_dir))) is None, "a folder with a manifest is read, not indexed"
