"""`raywds convert SRC s3://bucket/prefix` (or gs://): convert into a local staging folder, then
put the shards into the bucket and the manifest last.

The staging folder is the usual converter's output (raywds.data.convert), so an interrupted
conversion resumes there from its journal. The upload then skips every shard the bucket
already holds with the same size and sha256 (kept in the object's metadata), uploads the
others (s3: boto3's transfer manager, multipart above 64 MB; gs: a resumable upload that
continues where a broken connection left it, raywds.data.gcs), reads each one back from the
bucket against the manifest's sha256, and only then writes `_info.json` and `manifest.json`.
An older manifest at the prefix is deleted before the first shard changes, so a half-done
upload is never mistaken for a dataset.

    manifest = convert_to_bucket(Path("imagenet"), "s3://bucket/imagenet", options)
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from raywds.data import gcs, s3, stores
from raywds.data.columns import COLUMNS
from raywds.data.convert import ConvertOptions, ShardJob, convert, kept, write_shard
from raywds.data.listed import Tree
from raywds.data.manifest import MANIFEST, TIMM_INFO
from raywds.data.sources import SOURCES
from raywds.data.stores import Storage
from raywds.errors import DataError

MULTIPART_BYTES = 64 << 20


def staging_folder(url: str) -> Path:
    """Where a conversion to `url` is staged unless told: the same folder for the same
    destination, so that a rerun resumes."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"raywds-staging-{digest}"


def check_places(src: str, out: str) -> None:
    """`raywds convert` reads an image tree from a folder, a bucket or an HTTP listing and writes a
    folder or a bucket: one line otherwise."""
    if stores.scheme(src) not in (stores.LOCAL, stores.S3, stores.GS, stores.HTTP):
        raise DataError(
            f"convert reads an image tree from a folder, an s3:// or gs:// prefix or an http(s):// listing, and "
            f"{src} is a {stores.scheme(src)} location: copy the tree down first; for WebDataset shards already "
            f"there, `raywds index {src}` makes them trainable as they are"
        )
    if stores.scheme(out) not in (stores.LOCAL, stores.S3, stores.GS):
        raise DataError(
            f"convert writes shards to a local folder or an s3:// or gs:// prefix, not to {out}: convert into "
            "a folder and serve it (`raywds serve`)"
        )


def convert_to_bucket(
    src: Tree, url: str, options: ConvertOptions, *, staging: Path | None = None, storage: Storage = Storage()
) -> dict[str, Any]:
    """Convert `src` and upload the result under `url` (s3:// or gs://); returns the manifest, with
    the count of shards the bucket already held as `kept_in_bucket`."""
    if gcs.is_gs(url):
        gcs.check_bucket(url)
    else:
        s3.check_bucket(url, storage.s3_endpoint)  # a wrong key or bucket is one line before any work
    folder = staging or staging_folder(url)
    manifest = convert(src, folder, options)
    try:
        manifest["kept_in_bucket"] = upload(folder, manifest, url, storage)
    except s3.errors() as e:
        raise DataError(s3.error_line(e, url, storage.s3_endpoint)) from None
    return manifest


def bucket_at(url: str, storage: Storage = Storage()) -> _S3 | _Gcs:
    """The s3:// or gs:// prefix `url`, for putting shards and manifests under it."""
    return _Gcs(url) if gcs.is_gs(url) else _S3(url, storage.s3_endpoint)


def write_to_bucket(job: ShardJob, url: str, storage: Storage = Storage()) -> dict[str, Any]:
    """One shard written in this machine's temp folder, put under `url`, read back whole and
    removed here (what a Ray task of `convert --ray` to a bucket does); its record. A shard the
    bucket holds already as `job.done` describes it (size and sha256) is kept."""
    bucket = bucket_at(url, storage)
    try:
        if job.done is not None and bucket.holds(job.done["shard"]):
            return kept(job)
        with tempfile.TemporaryDirectory(prefix="raywds-shard-") as folder:
            here = dataclasses.replace(job, path=Path(folder) / job.path.name, done=None)
            record = write_shard(here)
            shard = record["shard"]
            bucket.put_file(here.path, shard)
            _check_back(stores.join(url, shard["name"]), shard, storage, partial(bucket.delete, shard["name"]))
    except s3.errors() as e:
        raise DataError(s3.error_line(e, url, storage.s3_endpoint)) from None
    return record


def publish(folder: Path, url: str, storage: Storage = Storage()) -> None:
    """The manifest files the converter wrote in `folder` put under `url`, the manifest last."""
    bucket = bucket_at(url, storage)
    for name in (SOURCES, TIMM_INFO, COLUMNS, MANIFEST):  # as the converter wrote them into the staging folder
        if (folder / name).is_file():  # (no columns or sources from a conversion staged by an older raywds)
            bucket.put_bytes(name, (folder / name).read_bytes())


def _key(prefix: str, name: str) -> str:
    return f"{prefix.rstrip('/')}/{name}" if prefix.rstrip("/") else name


def upload(folder: Path, manifest: dict[str, Any], url: str, storage: Storage = Storage()) -> int:
    """Put the shards of `manifest` from `folder` under `url`, then `folder`'s manifest files;
    returns how many shards were there already."""
    bucket = bucket_at(url, storage)
    shards = [shard for info in manifest["splits"].values() for shard in info["shards"]]
    missing = [shard for shard in shards if not bucket.holds(shard)]
    if missing:
        bucket.delete(MANIFEST)
    for shard in missing:
        bucket.put_file(folder / shard["name"], shard)
        _check_back(stores.join(url, shard["name"]), shard, storage, partial(bucket.delete, shard["name"]))
    publish(folder, url, storage)
    return len(shards) - len(missing)


class _S3:
    """An s3:// prefix, through boto3 (its transfer manager for the shards)."""

    def __init__(self, url: str, endpoint: str | None):
        self.bucket, self.prefix = s3.split(url)
        self.client = s3.client(endpoint)

    def holds(self, shard: dict[str, Any]) -> bool:
        """Whether the bucket has this very shard (size, and the sha256 our upload recorded)."""
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=_key(self.prefix, shard["name"]))
        except s3.errors() as e:
            if s3.status_and_code(e)[0] == 404:
                return False
            raise
        return head["ContentLength"] == shard["num_bytes"] and head.get("Metadata", {}).get("sha256") == shard["sha256"]

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=_key(self.prefix, name))

    def put_file(self, path: Path, shard: dict[str, Any]) -> None:
        from boto3.s3.transfer import TransferConfig

        transfer = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)
        extra = {"Metadata": {"sha256": shard["sha256"]}}
        key = _key(self.prefix, shard["name"])
        self.client.upload_file(str(path), self.bucket, key, ExtraArgs=extra, Config=transfer)

    def put_bytes(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=_key(self.prefix, name), Body=data)


class _Gcs:
    """A gs:// prefix, through the JSON API (raywds.data.gcs; resumable uploads for the shards)."""

    def __init__(self, url: str):
        self.url = url

    def holds(self, shard: dict[str, Any]) -> bool:
        """Whether the bucket has this very shard (size, and the sha256 our upload recorded)."""
        found = gcs.metadata(stores.join(self.url, shard["name"]))
        return (
            found is not None
            and int(found["size"]) == shard["num_bytes"]
            and (found.get("metadata") or {}).get("sha256") == shard["sha256"]
        )

    def delete(self, name: str) -> None:
        gcs.delete(stores.join(self.url, name))

    def put_file(self, path: Path, shard: dict[str, Any]) -> None:
        gcs.put_file(path, stores.join(self.url, shard["name"]), {"sha256": shard["sha256"]})

    def put_bytes(self, name: str, data: bytes) -> None:
        gcs.write_bytes(stores.join(self.url, name), data)


def _check_back(url: str, shard: dict[str, Any], storage: Storage, remove: Callable[[], None]) -> None:
    """Read the uploaded object back whole: the bucket must hold the bytes the manifest describes."""
    digest, size = hashlib.sha256(), 0
    with stores.open_shard(url, storage.read_policy()) as body:
        for chunk in iter(lambda: body.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    if size != shard["num_bytes"] or digest.hexdigest() != shard["sha256"]:
        remove()
        raise DataError(
            f"{url} read back as {size} bytes, sha256 {digest.hexdigest()[:12]}…, not the "
            f"{shard['num_bytes']} bytes and {shard['sha256'][:12]}… written; removed it: run the conversion again"
        )
