"""Re-read every shard and check it against the manifest.

    raywds verify shards/        # exit 1 with a list of problems, 0 if every shard is whole
    raywds verify s3://bucket/imagenet   # the same, each shard read once from the bucket
    raywds verify gs://bucket/imagenet-wds   # shards `raywds index` made a manifest for, wherever they are
    raywds verify 'https://host/x-{000..127}.tar'   # shards as --data names them: against the index a run made

`convert` runs `check_members` on each shard it writes, before the manifest lists it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tarfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from raywds.data import columns, s3, stores, tars
from raywds.data.layout import IMAGE_EXTENSIONS
from raywds.data.manifest import read_manifest, split_location, write_atomic
from raywds.data.members import Members
from raywds.data.stores import Storage
from raywds.data.tars import members
from raywds.errors import DataError, ShardError

IMAGE_KEYS = set(IMAGE_EXTENSIONS.values())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_members(path: Path | BinaryIO, num_samples: int) -> list[str]:
    """Problems with the samples of one tar, as webdataset groups them (key = member name up to
    its first dot): a sample without exactly one image and one .cls, or a count other than
    `num_samples`. Read with the loaders' own tar reader, at a quarter of tarfile's cost."""
    samples: dict[str, list[str]] = defaultdict(list)
    try:
        with open(path, "rb") if isinstance(path, Path) else contextlib.nullcontext(path) as stream:
            for name, _ in members(stream):
                key, _, ext = name.partition(".")
                samples[key].append(ext)
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        return [f"unreadable tar ({e})"]
    problems = []
    for key, exts in sorted(samples.items()):
        images = sorted(ext for ext in exts if ext in IMAGE_KEYS)
        if len(images) != 1:
            problems.append(
                f"sample {key} has no image"
                if not images
                else f"sample {key} has {len(images)} images ({', '.join(images)})"
            )
        if exts.count("cls") != 1:
            problems.append(
                f"sample {key} has no .cls" if "cls" not in exts else f"sample {key} has {exts.count('cls')} .cls"
            )
    if len(samples) != num_samples:
        problems.append(f"{len(samples)} samples, manifest says {num_samples}")
    return problems


def check_shard(path: Path, num_samples: int, num_bytes: int, sha256: str) -> list[str]:
    """Problems with one shard: missing, size, hash, unreadable tar, samples lacking image or class."""
    if not path.is_file():
        return [f"{path.name}: missing"]
    with open(path, "rb") as stream:
        return _check_stream(path.name, stream, num_samples, num_bytes, sha256)


def check_object(url: str, num_samples: int, num_bytes: int, sha256: str, endpoint: str | None = None) -> list[str]:
    """check_shard for a shard in a bucket."""
    name = url.rsplit("/", 1)[-1]
    with _object(url, endpoint) as body:
        return [f"{name}: missing"] if body is None else _check_stream(name, body, num_samples, num_bytes, sha256)


class _Counted:
    """A stream read through, counting and hashing its bytes (one pass for size, hash and members)."""

    def __init__(self, source: Any):
        self.source, self.digest, self.size = source, hashlib.sha256(), 0

    def seekable(self) -> bool:
        return False  # every byte goes through the hash

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.source.read(n)
        self.digest.update(data)
        self.size += len(data)
        return data


def _check_stream(
    name: str,
    stream: BinaryIO,
    num_samples: int,
    num_bytes: int,
    sha256: str,
    indexed: Members | None = None,
    first_key: str = "",
) -> list[str]:
    """Size, hash and members of one shard in a single read of `stream`; a shard `raywds index`
    listed (`indexed`) is checked by its own rules: its usable samples and its first key (and its
    sha256 where the index read it whole)."""
    counted = _Counted(stream)
    if indexed is None:
        problems = [f"{name}: {problem}" for problem in check_members(counted, num_samples)]  # type: ignore[arg-type]
    else:
        problems = [f"{name}: {p}" for p in _check_indexed(counted, num_samples, indexed, first_key)]  # type: ignore[arg-type]
    for _ in iter(lambda: counted.read(1 << 20), b""):  # the tar's end blocks count too
        pass
    size = [f"{name}: {counted.size} bytes, manifest says {num_bytes}"] if counted.size != num_bytes else []
    hashed = sha256 or indexed is None
    digest = [f"{name}: sha256 differs from the manifest"] if hashed and counted.digest.hexdigest() != sha256 else []
    return size + digest + problems


def _check_indexed(stream: BinaryIO, num_samples: int, rules: Members, first_key: str) -> list[str]:
    """A foreign shard's samples as the loader counts them (those with an image and a label member)."""
    try:
        found = tars.samples(tars.Entries(stream, wanted=lambda name, size: False))
        keys = [sample.key for sample in found if rules.usable(dict.fromkeys(sample.exts))]
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        return [f"unreadable tar ({e})"]
    problems = [f"{len(keys)} samples, manifest says {num_samples}"] if len(keys) != num_samples else []
    if first_key and keys[:1] != [first_key]:
        problems.append(f"first sample {keys[0] if keys else None}, manifest says {first_key}")
    return problems


@contextlib.contextmanager
def _object(url: str, endpoint: str | None) -> Iterator[BinaryIO | None]:
    """An s3 shard's body, streamed; None when the bucket has no such object."""
    bucket, key = s3.split(url)
    try:
        body = s3.client(endpoint).get_object(Bucket=bucket, Key=key)["Body"]
    except s3.errors() as e:
        status, code = s3.status_and_code(e)
        if status == 404 and code != "NoSuchBucket":
            yield None
            return
        raise DataError(s3.error_line(e, url, endpoint)) from None
    try:
        yield body
    finally:
        body.close()


def verify(location: str | Path, storage: Storage = Storage()) -> tuple[int, list[str]]:
    """(shards checked, problems) for every shard the manifest at `location` (a folder or an
    s3:// prefix) lists in `manifest.json`, or for shards named as --data names them (a brace list,
    a glob, a folder without a manifest) those the index a run made of them in the cache lists;
    when they all match, `manifest.npz` is (re)written from the JSON if it is missing or lists
    other shards (`in_step`)."""
    from raywds.data.dataset import cached_index  # (not imported by convert, which imports this module)

    cached = cached_index(str(location), storage)
    location = str(cached or location)
    manifest = read_manifest(location, storage=storage, use_columns=False)
    indexed = manifest.members if manifest.members.drop_incomplete else None
    problems: list[str] = []
    count = 0
    for split in manifest.splits:
        for shard in manifest.splits[split]:
            url = manifest.url(shard)
            expected = (shard.num_samples, shard.num_bytes, shard.sha256)
            if indexed is not None or stores.scheme(url) not in (stores.LOCAL, stores.S3):
                problems += _check_any(
                    url, shard.name, *expected, indexed, manifest.first_keys.get(shard.name, ""), storage
                )
            elif s3.is_s3(url):
                problems += check_object(url, *expected, storage.s3_endpoint)
            else:
                problems += check_shard(Path(url), *expected)
            count += 1
    if problems and cached is not None:
        problems.append(
            f"{cached}: the index of these shards that runs read, made before they changed: remove that folder "
            "and the next run indexes them again"
        )
    return count, problems or in_step(location, storage)


def _check_any(
    url: str,
    name: str,
    num_samples: int,
    num_bytes: int,
    sha256: str,
    indexed: Members | None,
    first_key: str,
    storage: Storage,
) -> list[str]:
    """check_shard for a shard anywhere raywds reads (raywds.data.stores), in one streaming read."""
    if stores.scheme(url) == stores.LOCAL and not Path(stores.local_path(url)).is_file():
        return [f"{name}: missing"]
    try:
        stream = stores.open_shard(url, storage.read_policy())
    except (ShardError, OSError) as e:
        return [f"{name}: {e}"]
    with contextlib.closing(stream):
        try:
            return _check_stream(name, stream, num_samples, num_bytes, sha256, indexed, first_key)
        except ShardError as e:
            return [f"{name}: {e}"]


def in_step(location: str, storage: Storage = Storage()) -> list[str]:
    """Write the columns of the manifest at `location` (raywds.data.columns) unless those there
    were made from this very JSON; problems when they cannot be written."""
    _, where = split_location(location)
    text = storage.read(where)
    raw = json.loads(text)
    wanted = columns.to_bytes(raw, len(text))
    target = where[: -len(".json")] + ".npz"
    try:
        if columns.same(storage.read(target), wanted):
            return []
    except FileNotFoundError:
        pass
    failures: tuple[type[BaseException], ...] = (OSError, DataError, *s3.errors())
    try:
        if stores.scheme(target) == stores.LOCAL:
            write_atomic(Path(stores.local_path(target)), wanted)
        else:
            storage.write(target, wanted)
    except failures as e:
        return [f"{target}: out of step with {where} and cannot be rewritten: {e}"]
    return []
