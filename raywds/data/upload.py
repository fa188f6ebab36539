"""`raywds convert SRC s3://bucket/prefix` (or gs://): convert into a local staging folder, then
put the shards into the bucket and the manifest last.

The staging folder is the usual converter's output (raywds.data.convert), so an interrupted
conversion resumes there from its journal. The upload then skips every shard the bucket
already holds with the same size and sha256 (kept in the object's metadata), uploads the
others through the bucket's store (raywds.data.stores: for s3 boto3's transfer manager,
multipart above 64 MB; for gs a resumable upload that continues where a broken connection
left it), reads each one back from the bucket against the manifest's sha256, and only then
writes `_info.json` and `manifest.json`.
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

from raywds.data import stores
from raywds.data.columns import COLUMNS
from raywds.data.convert import ConvertOptions, ShardJob, convert, kept, write_shard
from raywds.data.listed import Tree
from raywds.data.manifest import MANIFEST, TIMM_INFO
from raywds.data.sources import SOURCES
from raywds.data.stores import Storage
from raywds.errors import DataError


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
    storage.at(url).check(url)  # a wrong key or bucket is one line before any work
    folder = staging or staging_folder(url)
    manifest = convert(src, folder, options)
    manifest["kept_in_bucket"] = upload(folder, manifest, url, storage)
    return manifest


def write_to_bucket(job: ShardJob, url: str, storage: Storage = Storage()) -> dict[str, Any]:
    """One shard written in this machine's temp folder, put under `url`, read back whole and
    removed here (what a Ray task of `convert --ray` to a bucket does); its record. A shard the
    bucket holds already as `job.done` describes it (size and sha256) is kept."""
    if job.done is not None and _holds(url, job.done["shard"], storage):
        return kept(job)
    with tempfile.TemporaryDirectory(prefix="raywds-shard-") as folder:
        here = dataclasses.replace(job, path=Path(folder) / job.path.name, done=None)
        record = write_shard(here)
        _put(here.path, url, record["shard"], storage)
    return record


def publish(folder: Path, url: str, storage: Storage = Storage()) -> None:
    """The manifest files the converter wrote in `folder` put under `url`, the manifest last."""
    for name in (SOURCES, TIMM_INFO, COLUMNS, MANIFEST):  # as the converter wrote them into the staging folder
        if (folder / name).is_file():  # (no columns or sources from a conversion staged by an older raywds)
            storage.write(stores.join(url, name), (folder / name).read_bytes())


def upload(folder: Path, manifest: dict[str, Any], url: str, storage: Storage = Storage()) -> int:
    """Put the shards of `manifest` from `folder` under `url`, then `folder`'s manifest files;
    returns how many shards were there already."""
    shards = [shard for info in manifest["splits"].values() for shard in info["shards"]]
    missing = [shard for shard in shards if not _holds(url, shard, storage)]
    if missing:
        storage.at(url).delete(stores.join(url, MANIFEST))
    for shard in missing:
        _put(folder / shard["name"], url, shard, storage)
    publish(folder, url, storage)
    return len(shards) - len(missing)


def _holds(url: str, shard: dict[str, Any], storage: Storage) -> bool:
    """Whether the bucket under `url` has this very shard (its size, and the sha256 our upload kept)."""
    where = stores.join(url, shard["name"])
    return storage.at(where).holds(where, shard["num_bytes"], shard["sha256"])


def _put(path: Path, url: str, shard: dict[str, Any], storage: Storage) -> None:
    """The shard at `path` put under `url` with its sha256, then read back whole against its record."""
    where = stores.join(url, shard["name"])
    store = storage.at(where)
    store.put_file(path, where, shard["sha256"])
    _check_back(where, shard, storage, partial(store.delete, where))


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
