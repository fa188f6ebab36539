"""Opening shards so that networks cannot hang or silently corrupt an epoch.

http(s): connect and read timeouts; a transient failure (refused, reset, timeout, 5xx, a
short body) is retried with backoff, resuming where it stopped with a Range request; a 404
or a shard that stays unreadable is an error naming the URL. Local paths open directly;
`pipe:` URLs (e.g. `pipe:aws s3 cp s3://bucket/x.tar -`) go to webdataset, which checks the
command's exit status. With a cache dir, each http shard is kept on local disk after its
first full, size-checked read.

Every shard is checked against its manifest entry as it is read: as many samples, no key
twice, and with `verify_hashes` the same sha256 (hashed while streaming, checked at the
shard's end). A shard that disagrees is always an error (`ShardMismatch`): an epoch must never
count wrong without a word. What happens to a shard that stays unreadable is the caller's
policy: split mode raises (an exact epoch cannot lose a shard); resample mode skips it with a
counted warning, and gives up when several shards in a row fail (the server is down).

    expected = {url: Expected(num_samples=1000, sha256=...)}
    for sample in tar_samples([{"url": u} for u in urls], ReadPolicy(skip_unreadable=True), expected): ...
"""

from __future__ import annotations

import hashlib
import http.client
import io
import logging
import os
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import webdataset as wds

from raywds import tars
from raywds.errors import DataError

log = logging.getLogger(__name__)

TRANSIENT = (OSError, http.client.HTTPException, socket.timeout)


@dataclass(frozen=True, kw_only=True)
class ReadPolicy:
    """How hard to try, and what to do with a shard that stays unreadable."""

    read_timeout_s: float = 60.0
    """Longest wait for the next bytes of a shard (and for a connection, capped at 10 s)."""
    retries: int = 3
    """Retries of a transient failure, with backoff 1, 2, 4, ... s, resuming with a Range request."""
    backoff_s: float = 1.0
    skip_unreadable: bool = False
    """True (resample mode): skip the shard with a warning; False (split mode): raise."""
    max_failures_in_a_row: int = 5
    """Skipping gives up after this many unreadable shards in a row: the source is down."""
    cache_dir: str | None = None
    """Keep each http shard here after its first complete read, and read it from here after."""


class ShardError(DataError):
    """A shard could not be read; the message names its URL."""


def _status_error(url: str, status: int, reason: str) -> ShardError:
    if status == 404:
        return ShardError(f"shard {url} is missing on the server (HTTP 404); is the server serving the folder the manifest describes?")
    return ShardError(f"shard {url} answered HTTP {status} {reason}")


class HttpShard(io.RawIOBase):
    """An http(s) shard as a file, resuming with `Range` after a transient failure."""

    def __init__(self, url: str, policy: ReadPolicy, size: int | None = None):
        self.url = url
        self.policy = policy
        self.size = size
        self.pos = 0
        self.failures = 0
        self._conn: http.client.HTTPConnection | None = None
        self._response: http.client.HTTPResponse | None = None
        try:
            self._connect()
        except TRANSIENT as e:
            self._recover(e)

    def readable(self) -> bool:
        return True

    def _connect(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.hostname or "", parts.port, timeout=min(10.0, self.policy.read_timeout_s))
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(self.policy.read_timeout_s)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Range": f"bytes={self.pos}-"} if self.pos else {})
        response = conn.getresponse()
        if response.status >= 500:
            conn.close()
            raise OSError(f"HTTP {response.status} {response.reason}")
        if response.status not in (200, 206):
            conn.close()
            raise _status_error(self.url, response.status, response.reason)
        if self.pos and response.status == 200:  # the server ignored the range: skip what we have
            remaining = self.pos
            while remaining:
                chunk = response.read(min(remaining, 1 << 20))
                if not chunk:
                    raise OSError("body ended before the resume point")
                remaining -= len(chunk)
        if self.size is None:
            length = response.getheader("Content-Length")
            if length is not None and response.status == 200:
                self.size = int(length)
        self._conn, self._response = conn, response

    def _recover(self, cause: BaseException) -> None:
        """Reconnect at self.pos after a transient failure, waiting backoff x 1, 2, 4, ... s;
        failures count until bytes flow again, so a server that accepts and then stalls
        uses up the retries too."""
        last = cause
        while True:
            self.failures += 1
            if self.failures > self.policy.retries:
                where = f"at byte {self.pos}" if self.pos else "when opening it"
                raise ShardError(f"shard {self.url}: cannot read it {where}: {last} (after {self.policy.retries} retries)")
            time.sleep(self.policy.backoff_s * 2 ** (self.failures - 1))
            self._drop()
            try:
                self._connect()
                return
            except TRANSIENT as e:  # a ShardError (404, 4xx) is not transient and goes up
                last = e

    def readinto(self, buffer: Any) -> int:
        while True:
            try:
                assert self._response is not None
                n = self._response.readinto(buffer)
                if n == 0 and self.size is not None and self.pos < self.size:
                    raise OSError(f"connection closed at byte {self.pos} of {self.size}")
                self.pos += n
                if n:
                    self.failures = 0
                return n
            except TRANSIENT as e:
                self._recover(e)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._response = None, None

    def close(self) -> None:
        self._drop()
        super().close()


class CachingReader(io.RawIOBase):
    """Reads `source` and writes a copy; the copy becomes `path` only when complete and intact."""

    def __init__(self, source: BinaryIO, path: Path, size: int | None, sha256: str | None):
        self.source, self.path, self.size, self.sha256 = source, path, size, sha256
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        self.tmp = Path(tmp)
        self.out: BinaryIO | None = os.fdopen(fd, "wb")
        self.hash = hashlib.sha256()
        self.written = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.source.readinto(buffer)  # type: ignore[attr-defined]
        if self.out is not None:
            if n:
                view = memoryview(buffer)[:n]
                self.out.write(view)
                self.hash.update(view)
                self.written += n
            else:
                self._finish()
        return n

    def _finish(self) -> None:
        assert self.out is not None
        self.out.close()
        self.out = None
        intact = (self.size is None or self.written == self.size) and (not self.sha256 or self.hash.hexdigest() == self.sha256)
        if intact:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)
            log.warning("not caching %s: %d bytes, sha256 %s… differ from the manifest", self.path.name, self.written, self.hash.hexdigest()[:12])

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None
            self.tmp.unlink(missing_ok=True)
        self.source.close()
        super().close()


def cache_path(cache_dir: str, url: str) -> Path:
    """A place per URL: the shard's name, prefixed by a hash of the URL, so datasets never collide."""
    return Path(cache_dir) / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{url.rsplit('/', 1)[-1]}"


def open_shard(url: str, policy: ReadPolicy, *, size: int | None = None, sha256: str | None = None) -> BinaryIO:
    """A readable binary stream of the shard at `url` (http(s), pipe: or a local path)."""
    if url.startswith(("http://", "https://")):
        if policy.cache_dir:
            cached = cache_path(policy.cache_dir, url)
            if cached.is_file() and (size is None or cached.stat().st_size == size):
                return open(cached, "rb")  # noqa: SIM115 - the caller closes it
            return io.BufferedReader(CachingReader(io.BufferedReader(HttpShard(url, policy, size)), cached, size, sha256), 1 << 20)  # type: ignore[arg-type]
        return io.BufferedReader(HttpShard(url, policy, size), 1 << 20)
    if url.startswith("pipe:"):
        return wds.gopen(url)  # type: ignore[no-any-return]
    try:
        return open(url, "rb")  # noqa: SIM115 - the caller closes it
    except OSError as e:
        raise ShardError(f"shard {url}: cannot open it: {e.strerror}") from None


class Failures:
    """The policy for unreadable shards: raise, or warn, count and skip (up to a run of them).
    A shard that reads cleanly but disagrees with the manifest (`ShardMismatch`) always raises."""

    def __init__(self, policy: ReadPolicy):
        self.policy = policy
        self.skipped: list[str] = []
        """Why each skipped shard was skipped (one line each), for the batches to carry."""
        self.in_a_row = 0

    def __call__(self, exn: ShardError) -> None:
        if not self.policy.skip_unreadable or isinstance(exn, ShardMismatch):
            raise exn
        self.skipped.append(str(exn))
        self.in_a_row += 1
        if self.in_a_row >= self.policy.max_failures_in_a_row:
            raise ShardError(f"{self.in_a_row} shards in a row were unreadable, the last: {exn}; is the shard server down?") from exn
        log.warning("skipped an unreadable shard (%s); %d skipped by this loader worker", exn, len(self.skipped))

    def succeeded(self) -> None:
        self.in_a_row = 0


@dataclass(frozen=True)
class Expected:
    """What the manifest says one shard holds; reading it must agree."""

    num_samples: int
    num_bytes: int | None = None
    sha256: str | None = None
    first_id: int = 0
    """The id of its first sample: shards are numbered through the split in manifest order."""


class ShardMismatch(ShardError):
    """A shard read to its end disagrees with its manifest entry (samples, keys or sha256)."""


class _Hashing(io.RawIOBase):
    """Passes a stream through, hashing what is read (for --verify-hashes)."""

    def __init__(self, source: BinaryIO):
        self.source, self.hash, self.num_bytes = source, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if hasattr(self.source, "readinto"):
            n: int = self.source.readinto(buffer)
        else:  # webdataset's pipe: streams only read
            data = self.source.read(len(buffer))
            n = len(data)
            buffer[:n] = data
        self.hash.update(memoryview(buffer)[:n])
        self.num_bytes += n
        return n


def shard_samples(url: str, stream: BinaryIO, expected: Expected, *, verify_hash: bool = False) -> Iterator[dict[str, Any]]:
    """One shard's samples, each with its `__id__`; raises ShardError naming the shard (and the
    last good key) when the tar cannot be read, and ShardMismatch when what it holds differs
    from `expected`: more or fewer samples, a key twice, or (`verify_hash`) another sha256."""
    hashing = _Hashing(stream) if verify_hash else None
    source: BinaryIO = io.BufferedReader(hashing, 1 << 20) if hashing is not None else stream  # type: ignore[arg-type]
    seen: set[str] = set()
    key = ""
    try:
        for sample in wds.tariterators.group_by_keys(tars.tar_files([{"url": url, "stream": source}], handler=_reraise)):
            key = sample["__key__"]
            if key in seen:
                raise ShardMismatch(f"shard {url}: key {key} appears twice; the shard is corrupt, reconvert it")
            if len(seen) >= expected.num_samples:
                raise ShardMismatch(f"shard {url} holds more than the {expected.num_samples} samples its manifest entry lists; the shard or manifest.json changed, run `raywds verify`")
            sample["__id__"] = expected.first_id + len(seen)
            seen.add(key)
            yield sample
        if hashing is not None:
            source.read()  # the tar's closing blocks count in its sha256 too
    except ShardError:
        raise
    except Exception as e:  # noqa: BLE001 - tarfile, webdataset and the stream raise many types
        after = f"after sample {key}" if key else "before its first sample"
        raise ShardError(f"shard {url}: cannot read it {after}: {_reason(e)}") from e
    if len(seen) != expected.num_samples:
        raise ShardMismatch(f"shard {url} holds {len(seen)} samples, its manifest entry {expected.num_samples}; the shard was cut short or changed, run `raywds verify`")
    if hashing is not None and expected.sha256 and hashing.hash.hexdigest() != expected.sha256:
        raise ShardMismatch(
            f"shard {url}: sha256 {hashing.hash.hexdigest()[:12]}… ({hashing.num_bytes} bytes) differs from the manifest's "
            f"{expected.sha256[:12]}… ({expected.num_bytes} bytes); the shard is corrupt, run `raywds verify`"
        )


def _reraise(exn: BaseException) -> bool:
    raise exn


def _reason(e: BaseException) -> str:
    """An exception's first line, with webdataset's extra args left out."""
    text = str(e.args[0]) if e.args else ""
    return (text.splitlines() or [""])[0] or type(e).__name__


def tar_samples(
    sources: Iterable[dict[str, Any]], policy: ReadPolicy, expected: dict[str, Expected], *, verify_hashes: bool = False, failures: Failures | None = None,
) -> Iterator[dict[str, Any]]:  # fmt: skip
    """{url} dicts -> samples with `__url__`, `__key__` and `__id__`, each shard checked against
    `expected` (by URL), read by `policy`: an unreadable shard raises or is skipped into `failures`."""
    failures = failures if failures is not None else Failures(policy)
    for source in sources:
        url = source["url"]
        shard = expected[url]
        try:
            stream = open_shard(url, policy, size=shard.num_bytes, sha256=shard.sha256)
        except (ShardError, OSError) as e:
            failures(e if isinstance(e, ShardError) else ShardError(f"shard {url}: cannot open it: {e}"))
            continue
        try:
            yield from shard_samples(url, stream, shard, verify_hash=verify_hashes)
            stream.close()  # a pipe: command's exit status arrives here
            failures.succeeded()
        except ShardError as e:
            failures(e)
        except OSError as e:
            failures(ShardError(f"shard {url}: {e}"))
        finally:
            stream.close()
