"""Reading shards into samples, each shard opened by raywds.data.stores.

Every shard is checked against its manifest entry: its size as it is opened, its first key (where
the manifest has it) before that sample is used, and as it is read as many samples, no key twice,
and with `verify_hashes` the same sha256 (checked at its end). A shard that disagrees is always an
error (`ShardMismatch`): an epoch must never count wrong without a word. A shard that stays
unreadable is the caller's policy: split mode raises (an exact epoch cannot lose a shard);
resample mode skips it with a counted warning, and gives up when several in a row fail.

    expected = {url: Expected(num_samples=1000, sha256=...)}
    for sample in tar_samples([{"url": u} for u in urls], ReadPolicy(skip_unreadable=True), expected): ...
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import webdataset as wds

from raywds.data import tars
from raywds.data.http import ReadPolicy
from raywds.data.members import Members
from raywds.data.stores import open_shard
from raywds.errors import ANOTHER_SHARD, ShardError, ShardMismatch

log = logging.getLogger(__name__)
RETRIES_LOCK = threading.Lock()


class Failures:
    """The policy for unreadable shards: raise, or warn, count and skip (up to a run of them).
    A shard that reads cleanly but disagrees with the manifest (`ShardMismatch`) always raises."""

    def __init__(self, policy: ReadPolicy):
        self.policy = policy
        self.skipped: list[str] = []
        """Why each skipped shard was skipped (one line each), for the batches to carry."""
        self.in_a_row = 0
        self.retries = 0
        """Reads retried after a transient failure (prefetching threads count here too)."""

    def retried(self) -> None:
        with RETRIES_LOCK:  # module-level: a Failures travels to loader workers pickled
            self.retries += 1

    def __call__(self, exn: ShardError) -> None:
        if not self.policy.skip_unreadable or isinstance(exn, ShardMismatch):
            raise exn
        self.skipped.append(str(exn))
        self.in_a_row += 1
        if self.in_a_row >= self.policy.max_failures_in_a_row:
            raise ShardError(
                f"{self.in_a_row} shards in a row were unreadable, the last: {exn}; is the shard server down?"
            ) from exn
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
    first_key: str = ""
    """Its first sample's key, where the manifest records it: checked before that sample is used."""
    members: Members | None = None
    """Indexed shards: a sample without an image or label member is passed over, as the index did."""


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


def shard_samples(
    url: str, stream: BinaryIO, expected: Expected, *, verify_hash: bool = False
) -> Iterator[dict[str, Any]]:
    """One shard's samples, each with its `__id__`; raises ShardError naming the shard (and the
    last good key) when the tar cannot be read, and ShardMismatch when what it holds differs
    from `expected`: more or fewer samples, a key twice, or (`verify_hash`) another sha256."""
    hashing = _Hashing(stream) if verify_hash else None
    source: BinaryIO = io.BufferedReader(hashing, 1 << 20) if hashing is not None else stream  # type: ignore[arg-type]
    seen: set[str] = set()
    key = ""
    try:
        for sample in wds.tariterators.group_by_keys(
            tars.tar_files([{"url": url, "stream": source}], handler=_reraise), keys=tars.key_and_ext
        ):
            key = sample["__key__"]
            if expected.members is not None and not expected.members.usable(sample):
                continue
            if not seen and expected.first_key and key != expected.first_key:
                first = f"its first sample is {key}, its manifest entry's {expected.first_key}"
                raise ShardMismatch(f"shard {url}: {first}: {ANOTHER_SHARD}")
            if key in seen:
                raise ShardMismatch(f"shard {url}: key {key} appears twice; the shard is corrupt, reconvert it")
            if len(seen) >= expected.num_samples:
                raise ShardMismatch(
                    f"shard {url} holds more than the {expected.num_samples} samples its manifest entry lists; "
                    "the shard or manifest.json changed, run `raywds verify`"
                )
            sample["__id__"] = expected.first_id + len(seen)
            seen.add(key)
            yield sample
        if hashing is not None:
            source.read()  # the tar's closing blocks count in its sha256 too
    except ShardError:
        raise
    except Exception as e:
        after = f"after sample {key}" if key else "before its first sample"
        raise ShardError(f"shard {url}: cannot read it {after}: {_reason(e)}") from e
    if len(seen) != expected.num_samples:
        raise ShardMismatch(
            f"shard {url} holds {len(seen)} samples, its manifest entry {expected.num_samples}; "
            "the shard was cut short or changed, run `raywds verify`"
        )
    if hashing is not None and expected.sha256 and hashing.hash.hexdigest() != expected.sha256:
        raise ShardMismatch(
            f"shard {url}: sha256 {hashing.hash.hexdigest()[:12]}… ({hashing.num_bytes} bytes) "
            f"differs from the manifest's {expected.sha256[:12]}… ({expected.num_bytes} bytes); "
            "the shard is corrupt, run `raywds verify`"
        )


def _reraise(exn: BaseException) -> bool:
    raise exn


def _reason(e: BaseException) -> str:
    """An exception's first line, with webdataset's extra args left out."""
    text = str(e.args[0]) if e.args else ""
    return (text.splitlines() or [""])[0] or type(e).__name__


class Prefetch:
    """A shard fetched whole in a thread, while the reader decodes the one before it, into
    `buffers[spare]` (a loader worker's two buffers take turns: the shard being read and the next;
    a larger one replaces it where the shard does not fit), not a fresh bytes object for every
    shard that faults in a page at a time and is unmapped again (the workers' page faults a
    sample fell from 24 to 22: most of the rest come from a worker's start-up).
    What the fetch raises is raised when the shard's turn comes, as if it had been opened then."""

    def __init__(
        self, url: str, policy: ReadPolicy, shard: Expected, failures: Failures, buffers: list[bytearray], spare: int
    ):
        if len(buffers[spare]) < (shard.num_bytes or 0):
            buffers[spare] = bytearray(shard.num_bytes or 0)  # zeroed pages the fetch fills: no copy
        self.url, self.buffer, self.size = url, buffers[spare], 0
        self.error: Exception | None = None
        args = (policy, shard, failures)
        self.thread = threading.Thread(target=self._fetch, args=args, daemon=True, name="prefetch")
        self.thread.start()

    def _fetch(self, policy: ReadPolicy, shard: Expected, failures: Failures) -> None:
        try:
            with open_shard(
                self.url, policy, size=shard.num_bytes, sha256=shard.sha256, retried=failures.retried
            ) as stream:
                self.size = _filled(stream, self.buffer, shard.num_bytes or 0)  # known: _prefetching
                more = stream.read()  # b"" unless the shard outgrew its manifest entry
                if more:
                    self.buffer[self.size :] = more
                    self.size += len(more)
        except Exception as e:  # noqa: BLE001 - handed to the reader, which decides
            self.error = e

    def stream(self) -> BinaryIO:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return cast(BinaryIO, Held(memoryview(self.buffer)[: self.size]))


def _filled(stream: Any, buffer: bytearray, size: int) -> int:
    """Read up to `size` bytes of `stream` into the start of `buffer`; how many came."""
    with memoryview(buffer) as view:
        got = 0
        while got < size and (n := stream.readinto(view[got:size])):
            got += n
    return got


class Held(io.RawIOBase):
    """A prefetched shard's bytes as a stream; each read is a copy, as the samples outlive the
    buffer. Closing it lets the buffer go to the next prefetch."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        end = len(self.view) if size is None or size < 0 else min(self.pos + size, len(self.view))
        data, self.pos = bytes(self.view[self.pos : end]), end
        return data

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self.view) - self.pos)
        buffer[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n

    def close(self) -> None:
        self.view.release()
        super().close()


def _with_next(items: Iterable[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each item with the one after it (None after the last): what to prefetch."""
    queue = iter(items)
    current = next(queue, None)
    while current is not None:
        following = next(queue, None)
        yield current, following
        current = following


def _prefetching(url: str, shard: Expected, policy: ReadPolicy) -> bool:
    """A shard of known size up to `prefetch_bytes`, local or remote: a local one too, as this
    hides the disk's wait (a loader worker spent half its reading time on it where the page cache
    had let go of the shards; docs/performance.md). Not a `pipe:` command, which streams."""
    return not url.startswith("pipe:") and 0 < (shard.num_bytes or policy.prefetch_bytes + 1) <= policy.prefetch_bytes


def tar_samples(
    sources: Iterable[dict[str, Any]],
    policy: ReadPolicy,
    expected: dict[str, Expected],
    *,
    verify_hashes: bool = False,
    failures: Failures | None = None,
    opening: Callable[[str], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """{url} dicts -> samples with `__url__`, `__key__` and `__id__`, each shard checked against
    `expected` (by URL), read by `policy`: an unreadable shard raises or is skipped into `failures`.
    `opening` hears of each shard as it is opened."""
    failures = failures if failures is not None else Failures(policy)
    ahead: Prefetch | None = None
    buffers = [bytearray(), bytearray()]
    for source, following in _with_next(sources):
        url = source["url"]
        shard = expected[url]
        if opening is not None:
            opening(url)
        fetched, ahead = ahead if ahead is not None and ahead.url == url else None, None
        try:
            stream = (
                fetched.stream()
                if fetched
                else open_shard(url, policy, size=shard.num_bytes, sha256=shard.sha256, retried=failures.retried)
            )
        except (ShardError, OSError) as e:
            failures(e if isinstance(e, ShardError) else ShardError(f"shard {url}: cannot open it: {e}"))
            continue
        if following is not None and _prefetching(following["url"], expected[following["url"]], policy):
            spare = 1 if fetched is not None and fetched.buffer is buffers[0] else 0
            ahead = Prefetch(following["url"], policy, expected[following["url"]], failures, buffers, spare)
        try:
            yield from shard_samples(url, stream, shard, verify_hash=verify_hashes)
            stream.read()  # the tar's closing blocks: a --cache-dir copy is kept only once complete
            stream.close()  # a pipe: command's exit status arrives here
            failures.succeeded()
        except ShardError as e:
            failures(e)
        except OSError as e:
            failures(ShardError(f"shard {url}: {e}"))
        finally:
            with contextlib.suppress(OSError):  # a pipe says its exit status again: its failure was handled above
                stream.close()
