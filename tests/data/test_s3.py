"""Shards in a bucket, against a real S3 server (SeaweedFS, tests/support/s3server.py), some requests
through a proxy that records them (tests/support/s3proxy.py): convert into it, verify from it, the
one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.data import check_a_bucket_holds_its_own_shards_only
from support.s3proxy import S3Proxy
from support.s3server import S3Server

from raywds.data import s3 as store
from raywds.data.columns import ShardTable
from raywds.data.convert import ConvertOptions, convert
from raywds.data.listed import tree_at
from raywds.data.manifest import read_manifest
from raywds.data.stores import Storage
from raywds.data.upload import convert_to_bucket
from raywds.data.verify import verify
from raywds.errors import DataError

OPTIONS = ConvertOptions(maxcount=16, seed=3)


LAST = ["sources.npz", "_info.json", "manifest.npz", "manifest.json"]
"""What a conversion puts after every shard is in the bucket: the manifest last."""


def puts(proxy: S3Proxy) -> list[str]:
    """The object names PUT through the proxy, in order (a multipart part counts once per part)."""
    return [path.rsplit("/", 1)[-1] for method, path, _ in proxy.log if method == "PUT"]


def test_convert_into_a_bucket_puts_every_shard_then_the_manifest_and_resumes(
    s3: S3Server, tree: Path, tmp_path: Path
) -> None:
    """The manifest is the last object written, after every shard was read back; a second run
    writes nothing new; a conversion cut short (three shards and the manifest gone) puts back
    exactly those three, then the manifest."""
    with S3Proxy(s3, path=r"$^") as proxy:
        url, endpoint = s3.url("ds"), proxy.endpoint
        manifest = convert_to_bucket(tree, url, OPTIONS, staging=tmp_path / "stage", storage=Storage(endpoint))
        names = [s["name"] for info in manifest["splits"].values() for s in info["shards"]]
        assert len(names) == 12 and sorted(puts(proxy)[: -len(LAST)]) == sorted(names)
        assert puts(proxy)[-len(LAST) :] == LAST
        read_backs = [path.rsplit("/", 1)[-1] for method, path, _ in proxy.log if method == "GET"]
        assert sorted(read_backs) == sorted(names)  # each shard read back once, before the manifest
        assert verify(url, Storage(endpoint)) == (12, [])

        proxy.log.clear()
        again = convert_to_bucket(tree, url, OPTIONS, staging=tmp_path / "stage", storage=Storage(endpoint))
        assert again["kept_in_bucket"] == 12 and puts(proxy) == LAST

        client = s3.client()
        gone = names[2:5]
        for key in [*gone, "manifest.json"]:
            client.delete_object(Bucket=s3.bucket, Key=f"ds/{key}")
        proxy.log.clear()
        resumed = convert_to_bucket(tree, url, OPTIONS, staging=tmp_path / "stage", storage=Storage(endpoint))
        assert resumed["kept_in_bucket"] == 9
        assert sorted(puts(proxy)[: -len(LAST)]) == sorted(gone) and puts(proxy)[-len(LAST) :] == LAST
    assert verify(url) == (12, [])
    assert read_manifest(url).num_samples("train") == 120
    assert isinstance(read_manifest(url).splits["train"], ShardTable)  # from the columns in the bucket


def test_a_bucket_holds_a_shard_at_its_size_with_the_sha256_put_with_it(s3: S3Server, tmp_path: Path) -> None:
    """What an upload skips: an object of the shard's size whose metadata holds the shard's sha256."""

    def put_plain(data: bytes) -> None:
        s3.client().put_object(Bucket=s3.bucket, Key="held/a.tar", Body=data)

    check_a_bucket_holds_its_own_shards_only(s3.url("held/a.tar"), tmp_path, put_plain, "s3://nothere/x/")


def test_a_damaged_object_is_found_by_verify_and_replaced_by_convert(s3: S3Server, tree: Path, tmp_path: Path) -> None:
    url = s3.url("ds")
    manifest = convert_to_bucket(tree, url, OPTIONS, staging=tmp_path / "stage")
    name = manifest["splits"]["train"]["shards"][1]["name"]
    data = bytearray((tmp_path / "stage" / name).read_bytes())
    data[700] ^= 0xFF
    s3.client().put_object(Bucket=s3.bucket, Key=f"ds/{name}", Body=bytes(data))
    count, problems = verify(url)
    assert count == 12 and problems == [f"{name}: sha256 differs from the manifest"], problems
    again = convert_to_bucket(tree, url, OPTIONS, staging=tmp_path / "stage")
    assert again["kept_in_bucket"] == 11 and verify(url) == (12, [])
    s3.client().delete_object(Bucket=s3.bucket, Key=f"ds/{name}")
    assert verify(url) == (12, [f"{name}: missing"])


def raywds(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "raywds", *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


@pytest.mark.slow
def test_wrong_key_missing_bucket_and_missing_manifest_are_one_line_each(
    s3: S3Server, tree: Path, tmp_path: Path
) -> None:
    """From the command line, as a user meets them: exit 1, one line, the bucket or key named."""
    import os

    convert_to_bucket(tree, s3.url("ds"), OPTIONS, staging=tmp_path / "stage")
    env = {**os.environ, **s3.env()}
    wrong = raywds("verify", s3.url("ds"), env={**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    no_bucket = raywds("verify", f"s3://{s3.bucket}-nope/ds", env=env)
    no_manifest = raywds("verify", s3.url("elsewhere"), env=env)
    no_bucket_to_write = raywds("convert", str(tree), f"s3://{s3.bucket}-nope/ds", env=env)
    for run, words in [
        (wrong, [f"s3://{s3.bucket}/ds/manifest.json", "refused the credentials", "403", "AWS_SECRET_ACCESS_KEY"]),
        (no_bucket, [f"bucket '{s3.bucket}-nope' does not exist", "NoSuchBucket", s3.endpoint]),
        (no_manifest, [f"no manifest at s3://{s3.bucket}/elsewhere/manifest.json", "raywds convert"]),
        (no_bucket_to_write, [f"bucket '{s3.bucket}-nope' does not exist", "create it"]),
    ]:
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and all(word in lines[0] for word in words), (words, run.stderr)
    assert not Path("s3:").exists()  # the old converter wrote a local folder named s3:


def test_read_manifest_names_refused_credentials(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    s3.client().put_object(Bucket=s3.bucket, Key="m/manifest.json", Body=json.dumps({"format": "x"}).encode())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(DataError, match=r"refused the credentials \(HTTP 403 "):
        read_manifest(s3.url("m"))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(DataError, match="no S3 credentials: set AWS_ACCESS_KEY_ID"):
        read_manifest(s3.url("m"))
    assert store.split("s3://b/k/x.tar") == ("b", "k/x.tar")


def test_convert_from_an_s3_prefix_into_one_gives_the_shards_of_a_local_copy(
    s3: S3Server, tree: Path, tmp_path: Path
) -> None:
    """An image tree in a bucket, converted into another prefix of it: listed once (a neighbour
    prefix that starts with the same letters is not part of it), read object by object, the same
    shards as the local converter makes from a local copy."""
    client = s3.client()
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        client.upload_file(str(path), s3.bucket, f"images/{path.relative_to(tree).as_posix()}")
    client.put_object(Bucket=s3.bucket, Key="images-old/train/stray/x.JPEG", Body=b"not part of the tree")
    here = tmp_path / "here"
    convert(tree, here, OPTIONS)
    manifest = convert_to_bucket(tree_at(s3.url("images")), s3.url("ds"), OPTIONS, staging=tmp_path / "stage")
    assert (
        manifest["source"] == s3.url("images")
        and manifest["classes"] == json.loads((here / "manifest.json").read_text())["classes"]
    )
    for shard in here.glob("*.tar"):
        body = client.get_object(Bucket=s3.bucket, Key=f"ds/{shard.name}")["Body"].read()
        assert body == shard.read_bytes(), shard.name
    with pytest.raises(DataError, match=r"s3://.*/nothing holds no objects"):
        tree_at(s3.url("nothing"))


def test_a_listed_tree_reads_every_file_at_its_storage_beside_it_and_in_another_process(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree listed at an endpoint (not AWS_ENDPOINT_URL's, here a port nothing listens on) reads
    its files there, a file beside its prefix (the Kaggle labels a layout looks for next to the tree)
    and a file sent to another process (a Ray task's) too. The file beside it was read at
    AWS_ENDPOINT_URL's, else AWS: only the listed files kept the endpoint."""
    import pickle

    client = s3.client()
    client.put_object(Bucket=s3.bucket, Key="images/train/a/x.JPEG", Body=b"x")
    client.put_object(Bucket=s3.bucket, Key="labels.csv", Body=b"beside")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: refused at once
    root = tree_at(s3.url("images"), Storage(s3.endpoint))
    image = root / "train" / "a" / "x.JPEG"
    assert image.read_bytes() == b"x"
    assert (root.parent / "labels.csv").read_bytes() == b"beside"
    assert pickle.loads(pickle.dumps(image)).read_bytes() == b"x"
