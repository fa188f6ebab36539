"""Reading one remote shard so that a network cannot hang or silently corrupt an epoch.

http(s), s3:// and gs://: connect and read timeouts; a transient failure (refused, reset,
timeout, 5xx, S3's 503 SlowDown, a short body) is retried with backoff (or the store's
Retry-After), resuming where it stopped with a Range request; a 404, refused credentials or a
shard that stays unreadable is an error naming the object. The s3:// and gs:// readers are
this one's with their own GET (raywds.data.s3.S3Shard, raywds.data.gcs.GcsShard); each store of
raywds.data.stores opens its own.

    with io.BufferedReader(HttpShard("http://head:8080/imagenet-train-000000.tar", ReadPolicy())) as stream: ...
"""

from __future__ import annotations

import http.client
import io
import logging
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raywds.data.cache import read_all
from raywds.errors import ShardError, ShardMismatch

log = logging.getLogger(__name__)

TRANSIENT = (OSError, http.client.HTTPException, socket.timeout)
PIECE = 1 << 20
"""Bytes one read of an http(s) or gs:// response fills at most, and so reads again, at most,
after a broken connection. Smaller pieces resume nearer the byte but cost every read: over a
local GCS emulator 64 KiB pieces halved the reader's MB/s and doubled its CPU (benchmarks/gcs_bench.py)."""


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
    """Keep each http or s3 shard here after its first complete read, and read it from here after."""
    s3_endpoint: str | None = None
    """The S3-compatible store for s3:// shards (None: AWS_ENDPOINT_URL, else AWS)."""
    prefetch_bytes: int = 256 << 20
    """Read the next shard (a file, http or s3; not a `pipe:` command) whole while the current
    one is decoded, when it is at most this big (one shard ahead per reader); 0: never."""


def size_mismatch(url: str, actual: int, listed: int) -> ShardMismatch:
    """A shard of another size than its manifest entry's: not the shard the manifest lists."""
    return ShardMismatch(
        f"shard {url} is {actual} bytes, its manifest entry {listed}: it changed after the manifest was made; "
        "run `raywds verify` on the run's --data (or `raywds index` again for shards raywds did not write)"
    )


class HttpShard(io.RawIOBase):
    """An http(s) shard as a file, resuming with `Range` after a transient failure."""

    transient: tuple[type[BaseException], ...] = TRANSIENT

    def __init__(
        self, url: str, policy: ReadPolicy, size: int | None = None, retried: Callable[[], None] | None = None
    ):
        self.url = url
        self.retried = retried
        """Called at each retry (the loader counts them into metrics.jsonl's `read_retries`)."""
        self.policy = policy
        self.size = size
        self.pos = 0
        self.failures = 0
        self._conn: http.client.HTTPConnection | None = None
        self._response: http.client.HTTPResponse | None = None
        try:
            self._connect()
        except self.transient as e:
            self._recover(e)

    def readable(self) -> bool:
        return True

    def _address(self) -> tuple[str, dict[str, str]]:
        """The URL to GET and the headers it needs."""
        return self.url, {}

    def _refused(self, status: int, reason: str) -> ShardError:
        """The error for an answer that no retry changes (4xx)."""
        if status == 404:
            return ShardError(
                f"shard {self.url} is missing on the server (HTTP 404); is the server serving the folder the "
                "manifest describes?"
            )
        return ShardError(f"shard {self.url} answered HTTP {status} {reason}")

    def _connect(self) -> None:
        address, extra = self._address()
        parts = urllib.parse.urlsplit(address)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.hostname or "", parts.port, timeout=min(10.0, self.policy.read_timeout_s))
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(self.policy.read_timeout_s)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={**extra, **({"Range": f"bytes={self.pos}-"} if self.pos else {})})
        response = conn.getresponse()
        if response.status >= 500:
            conn.close()
            raise OSError(f"HTTP {response.status} {response.reason}")
        if response.status not in (200, 206):
            conn.close()
            raise self._refused(response.status, response.reason)
        if self.pos and response.status == 200:  # the server ignored the range: skip what we have
            remaining = self.pos
            while remaining:
                chunk = response.read(min(remaining, 1 << 20))
                if not chunk:
                    raise OSError("body ended before the resume point")
                remaining -= len(chunk)
        length = response.getheader("Content-Length")
        if length is not None and response.status == 200:
            if self.size is not None and not self.pos and int(length) != self.size:
                conn.close()
                raise size_mismatch(self.url, int(length), self.size)
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
                raise ShardError(
                    f"shard {self.url}: cannot read it {where}: {last} (after {self.policy.retries} retries)"
                )
            time.sleep(self._wait_s(last))
            if self.retried is not None:
                self.retried()
            self._drop()
            try:
                self._connect()
                return
            except self.transient as e:  # a ShardError (404, 4xx) is not transient and goes up
                last = e

    def _wait_s(self, cause: BaseException) -> float:
        return self.policy.backoff_s * 2 ** (self.failures - 1)

    def readall(self) -> bytes:
        return read_all(self, None if self.size is None else self.size - self.pos)

    def readinto(self, buffer: Any) -> int:
        while True:
            try:
                assert self._response is not None
                # At most a PIECE at a time: http.client's readinto waits to fill what it is given and
                # drops it when the connection breaks, so the retry starts again at that piece's start.
                with memoryview(buffer) as view:
                    n = self._response.readinto(view[:PIECE])
                if n == 0 and self.size is not None and self.pos < self.size:
                    raise OSError(f"connection closed at byte {self.pos} of {self.size}")
                self.pos += n
                if n:
                    self.failures = 0
                return n
            except self.transient as e:
                self._recover(e)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._response = None, None

    def close(self) -> None:
        self._drop()
        super().close()


class StoreBusy(OSError):
    """A throttled or failing object store, or a broken connection to it: retried."""

    def __init__(self, line: str, retry_after_s: float | None):
        super().__init__(line)
        self.retry_after_s = retry_after_s
