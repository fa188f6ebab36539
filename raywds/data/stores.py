"""Where shards live: the one scheme table behind every reader, lister and writer in raywds.

A location is a local path (or `file://`), an `http(s)://` URL, an `s3://` or `gs://` object
or prefix, or a `pipe:` command whose output is the shard (`pipe:gsutil cat gs://b/x.tar`).
Every command asks `scheme()` before it treats a location as a path, so a URL is never
mistaken for a folder named `gs:`; a scheme raywds does not read is one line naming those it does.

    kind = scheme("gs://bucket/imagenet")                  # "gs"
    with open_shard(urls[0], ReadPolicy()) as stream: ...
    storage = Storage(s3_endpoint="http://127.0.0.1:8333")  # or a command's options' `.storage`
    storage.listing("s3://bucket/imagenet")                # whichever store the location names

Each kind of store is a class of its own (a `Store`: open a shard, read a small object whole, stat,
list, write; and for a bucket what an upload of shards needs: check it, whether it holds a shard,
put a file, delete), and STORES maps each scheme's kind to its class. `Storage` is every store as a
command reaches them: made once from its settings (only S3's store has one, its endpoint, which
it keeps inside), it is what the data functions take, so that a location never travels with an
S3 setting beside it. A store that cannot do a thing (list an http server, write through a
`pipe:` command) says so in one line naming what can.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from raywds.data import gcs, s3
from raywds.data.cache import CachingReader, cache_path
from raywds.data.http import HttpShard, ReadPolicy, size_mismatch
from raywds.errors import DataError, ShardError

LOCAL, HTTP, PIPE, S3, GS = "local", "http", "pipe", "s3", "gs"
SCHEMES = {"file": LOCAL, "http": HTTP, "https": HTTP, "s3": S3, "gs": GS}
"""Each URL scheme raywds reads, by the kind of store that serves it (`pipe:` has no `//`)."""
SHA256 = "sha256"
"""The user metadata key under which an uploaded shard's sha256 is kept with the object."""
READS = "local paths, file://, http(s)://, s3://, gs:// and pipe: commands"
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme(location: str) -> str:
    """The kind of store at `location` (LOCAL, HTTP, PIPE, S3 or GS); DataError for any other `x://`."""
    if location.startswith("pipe:"):
        return PIPE
    match = _SCHEME.match(location)
    if match is None:
        return LOCAL
    kind = SCHEMES.get(match[1].lower())
    if kind is None:
        raise DataError(f"{location}: raywds does not read {match[1]}:// locations; it reads {READS}")
    return kind


def is_url(location: str) -> bool:
    """A location under which names join with `/`, not a local path: http(s), s3 or gs."""
    return scheme(location) in (HTTP, S3, GS)


def local_path(location: str) -> str:
    """A local location as a path (`file:///x` -> `/x`)."""
    return location[len("file://") :] if location.startswith("file://") else location


def join(location: str, name: str) -> str:
    """`name` under a folder, URL or prefix."""
    if is_url(location):
        return location.rstrip("/") + "/" + name
    return str(Path(local_path(location)) / name)


class Store:
    """One kind of location: what raywds reads, lists and writes there. Each method takes the
    location it acts on; the base class refuses, in one line, what a kind of store cannot do."""

    kind: ClassVar[str]

    @classmethod
    def reaching(cls, storage: Storage) -> Store:
        """The store, set up to reach its locations as `storage` has it (only S3's needs a setting)."""
        return cls()

    def open(
        self,
        url: str,
        policy: ReadPolicy,
        *,
        size: int | None = None,
        sha256: str | None = None,
        retried: Callable[[], None] | None = None,
    ) -> BinaryIO:
        """A readable binary stream of the shard at `url` (see `open_shard`)."""
        raise NotImplementedError

    def read(self, where: str, timeout_s: float = 30.0) -> bytes:
        """A small object (a manifest, `_info.json`) whole; FileNotFoundError when absent."""
        raise NotImplementedError

    def stat(self, where: str, timeout_s: float = 30.0) -> tuple[int, str]:
        """(size in bytes, a stamp that changes when the object does); FileNotFoundError when absent."""
        raise NotImplementedError

    def listing(self, prefix: str) -> list[tuple[str, int, str]]:
        """(location, size, stamp) of each file under a folder or prefix, in any order."""
        raise DataError(
            f"{prefix}: an {self.kind} location cannot be listed; name its shards in brace notation "
            "(e.g. https://host/imagenet-train-{000000..001281}.tar)"
        )

    def write(self, where: str, data: bytes) -> None:
        """Write a small file (a manifest), whole or not at all."""
        raise self.unwritable(where)

    # A bucket's own: what `raywds convert` into one does (raywds.data.upload).

    def check(self, where: str) -> None:
        """One line before any work when the bucket of `where` is missing or refuses these credentials."""
        raise self.unwritable(where)

    def holds(self, where: str, size: int, sha256: str) -> bool:
        """Whether the object at `where` is this very file: its size, and the sha256 `put_file` kept with it."""
        raise self.unwritable(where)

    def put_file(self, path: Path, where: str, sha256: str) -> None:
        """Upload a file (a shard) to `where`, its sha256 kept with the object."""
        raise self.unwritable(where)

    def delete(self, where: str) -> None:
        """Remove the object at `where`; one that is not there is no error."""
        raise self.unwritable(where)

    def unwritable(self, where: str) -> DataError:
        return DataError(f"{where}: raywds cannot write to {self.kind} locations; write to a folder, s3:// or gs://")


class LocalStore(Store):
    """Local paths and `file://` URLs."""

    kind = LOCAL

    def open(
        self,
        url: str,
        policy: ReadPolicy,
        *,
        size: int | None = None,
        sha256: str | None = None,
        retried: Callable[[], None] | None = None,
    ) -> BinaryIO:
        try:
            stream = open(local_path(url), "rb")
        except OSError as e:
            raise ShardError(f"shard {url}: cannot open it: {e.strerror}") from None
        if size is not None and (actual := os.fstat(stream.fileno()).st_size) != size:
            stream.close()
            raise size_mismatch(url, actual, size)
        return stream

    def read(self, where: str, timeout_s: float = 30.0) -> bytes:
        return Path(local_path(where)).read_bytes()

    def stat(self, where: str, timeout_s: float = 30.0) -> tuple[int, str]:
        info = os.stat(local_path(where))
        return info.st_size, f"mtime:{info.st_mtime_ns}"

    def listing(self, prefix: str) -> list[tuple[str, int, str]]:
        root = Path(local_path(prefix))
        found = []
        for path in root.rglob("*") if root.is_dir() else ():
            if path.is_file():
                info = path.stat()
                found.append((str(path), info.st_size, f"mtime:{info.st_mtime_ns}"))
        return found

    def write(self, where: str, data: bytes) -> None:
        path = Path(local_path(where))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)


class RemoteStore(Store):
    """A store read over the network a shard at a time (`shard`: its reader), each shard kept
    in --cache-dir after its first full, size-checked read where the policy names one."""

    shard: ClassVar[type[HttpShard]]

    def open(
        self,
        url: str,
        policy: ReadPolicy,
        *,
        size: int | None = None,
        sha256: str | None = None,
        retried: Callable[[], None] | None = None,
    ) -> BinaryIO:
        if not policy.cache_dir:
            return io.BufferedReader(self.shard(url, policy, size, retried), 1 << 20)
        cached = cache_path(policy.cache_dir, url)
        if cached.is_file() and (size is None or cached.stat().st_size == size):
            return open(cached, "rb")
        reader = io.BufferedReader(self.shard(url, policy, size, retried))
        return io.BufferedReader(CachingReader(reader, cached, size, sha256), 1 << 20)  # type: ignore[arg-type]


class HttpStore(RemoteStore):
    """http(s):// servers (`raywds serve`, nginx, a CDN): read and stat; no listing, no writing."""

    kind = HTTP
    shard = HttpShard

    def read(self, where: str, timeout_s: float = 30.0) -> bytes:
        with _http(where, "GET", timeout_s) as response:
            return response.read()  # type: ignore[no-any-return]

    def stat(self, where: str, timeout_s: float = 30.0) -> tuple[int, str]:
        with _http(where, "HEAD", timeout_s) as response:
            stamp = response.headers.get("ETag") or response.headers.get("Last-Modified") or ""
            return int(response.headers.get("Content-Length", -1)), stamp.strip('"')


@dataclass(frozen=True)
class S3Store(RemoteStore):
    """s3:// buckets, at AWS or the S3-compatible store at `endpoint` (None: AWS_ENDPOINT_URL,
    else AWS); credentials from the standard chain (raywds.data.s3)."""

    endpoint: str | None = None
    kind = S3
    shard = s3.S3Shard

    @classmethod
    def reaching(cls, storage: Storage) -> Store:
        return cls(storage.s3_endpoint)

    def read(self, where: str, timeout_s: float = 30.0) -> bytes:
        return s3.read_bytes(where, self.endpoint, timeout_s)

    def stat(self, where: str, timeout_s: float = 30.0) -> tuple[int, str]:
        return s3.stat(where, self.endpoint, timeout_s)

    def listing(self, prefix: str) -> list[tuple[str, int, str]]:
        return list(s3.listing(prefix, self.endpoint))

    def write(self, where: str, data: bytes) -> None:
        s3.put_bytes(data, where, self.endpoint)

    def check(self, where: str) -> None:
        s3.check_bucket(where, self.endpoint)

    def holds(self, where: str, size: int, sha256: str) -> bool:
        found = s3.recorded(where, self.endpoint)
        return found is not None and found[0] == size and found[1].get(SHA256) == sha256

    def put_file(self, path: Path, where: str, sha256: str) -> None:
        s3.put_file(path, where, self.endpoint, {SHA256: sha256})

    def delete(self, where: str) -> None:
        s3.delete(where, self.endpoint)


class GcsStore(RemoteStore):
    """gs:// buckets through the JSON API, with Application Default Credentials (raywds.data.gcs)."""

    kind = GS
    shard = gcs.GcsShard

    def read(self, where: str, timeout_s: float = 30.0) -> bytes:
        return gcs.read_bytes(where, timeout_s)

    def stat(self, where: str, timeout_s: float = 30.0) -> tuple[int, str]:
        return gcs.stat(where, timeout_s)

    def listing(self, prefix: str) -> list[tuple[str, int, str]]:
        return list(gcs.listing(prefix))

    def write(self, where: str, data: bytes) -> None:
        gcs.write_bytes(where, data)

    def check(self, where: str) -> None:
        gcs.check_bucket(where)

    def holds(self, where: str, size: int, sha256: str) -> bool:
        found = gcs.metadata(where)
        return found is not None and int(found["size"]) == size and (found.get("metadata") or {}).get(SHA256) == sha256

    def put_file(self, path: Path, where: str, sha256: str) -> None:
        gcs.put_file(path, where, {SHA256: sha256})

    def delete(self, where: str) -> None:
        gcs.delete(where)


class PipeStore(Store):
    """`pipe:COMMAND`: the command's output is the shard; it has no size, listing or manifest."""

    kind = PIPE

    def open(
        self,
        url: str,
        policy: ReadPolicy,
        *,
        size: int | None = None,
        sha256: str | None = None,
        retried: Callable[[], None] | None = None,
    ) -> BinaryIO:
        return io.BufferedReader(Pipe(url[len("pipe:") :]), 1 << 20)  # type: ignore[arg-type]

    def read(self, where: str, timeout_s: float = 30.0) -> bytes:
        raise DataError(f"{where}: a pipe: command is read as a shard, not as a manifest; give the manifest's path")

    def stat(self, where: str, timeout_s: float = 30.0) -> tuple[int, str]:
        return -1, ""  # a command's output has neither size nor stamp before it runs


STORES: dict[str, type[Store]] = {LOCAL: LocalStore, HTTP: HttpStore, S3: S3Store, GS: GcsStore, PIPE: PipeStore}
"""Each kind of location (`scheme`'s answer) and the class of store that serves it."""


@dataclass(frozen=True)
class Storage:
    """Every store, as a command reaches them: made once from its settings (a command's options or a
    run's Source: `.storage`), and asked for what is at any location, whatever its scheme."""

    s3_endpoint: str | None = None
    """The S3-compatible store s3:// locations name (None: AWS_ENDPOINT_URL, else AWS)."""

    def at(self, location: str) -> Store:
        """The store that serves `location` (DataError for a scheme raywds does not read)."""
        return STORES[scheme(location)].reaching(self)

    def read(self, where: str, timeout_s: float = 30.0) -> bytes:
        """A small object (a manifest, `_info.json`) whole; FileNotFoundError when absent."""
        return self.at(where).read(where, timeout_s)

    def stat(self, where: str, timeout_s: float = 30.0) -> tuple[int, str]:
        """(size in bytes, a stamp that changes when the object does: its ETag, else its mtime);
        FileNotFoundError when absent. A `pipe:` command has neither: (-1, "")."""
        return self.at(where).stat(where, timeout_s)

    def write(self, where: str, data: bytes) -> None:
        """Write a small file (a manifest) to a folder or a bucket, whole or not at all."""
        self.at(where).write(where, data)

    def listing(self, prefix: str) -> list[tuple[str, int, str]]:
        """(location, size, stamp) of each file under a folder or bucket prefix, sorted by location."""
        return sorted(self.at(prefix).listing(prefix))

    def read_policy(self, **settings: Any) -> ReadPolicy:
        """How a shard here is read: ReadPolicy's `settings`, and this storage's."""
        return ReadPolicy(s3_endpoint=self.s3_endpoint, **settings)

    @classmethod
    def of(cls, policy: ReadPolicy) -> Storage:
        """The storage a shard reader's policy reaches (the policy travels to loader workers)."""
        return cls(policy.s3_endpoint)


def open_shard(
    url: str,
    policy: ReadPolicy,
    *,
    size: int | None = None,
    sha256: str | None = None,
    retried: Callable[[], None] | None = None,
) -> BinaryIO:
    """A readable binary stream of the shard at `url`, by its scheme. With `policy.cache_dir` a
    remote shard is kept on local disk after its first full, size-checked read. With `size`, a
    local file of another size is refused at once (it is not the shard the manifest lists)."""
    return Storage.of(policy).at(url).open(url, policy, size=size, sha256=sha256, retried=retried)


class Pipe(io.RawIOBase):
    """A `pipe:` command's output as a stream; closing it after the end raises when the command
    failed (a shard must not pass as complete because its reader gave up). A command stopped
    early by its reader (SIGPIPE) is not a failure."""

    def __init__(self, command: str):
        self.command = command
        self.process = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, bufsize=0)
        self.ended = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        assert self.process.stdout is not None
        n = self.process.stdout.readinto(buffer)  # type: ignore[attr-defined]
        if not n:
            self.ended = True
        return n or 0

    def close(self) -> None:
        if self.closed:
            return
        assert self.process.stdout is not None
        self.process.stdout.close()
        status = self.process.wait()
        super().close()
        if status and self.ended and status not in (-signal.SIGPIPE, 128 + signal.SIGPIPE):
            raise OSError(f"pipe: command {self.command!r} exited with status {status}")


@contextlib.contextmanager
def _http(url: str, method: str, timeout_s: float) -> Iterator[Any]:
    """An http(s) response to a small request; FileNotFoundError on a 404."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=timeout_s) as response:
            yield response
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise FileNotFoundError(url) from None
        raise


def sync_path(path: Path) -> None:
    """Flush a file, or a folder's entries (a rename in it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file so that a reader sees either the old file or the whole new one.

    The file gets 0666 less the umask, as open() gives the shards beside it: mkstemp's 0600
    hid the manifest from other users and from nginx in Docker."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
