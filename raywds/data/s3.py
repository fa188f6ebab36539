"""S3-compatible object stores (AWS S3, AIStore's S3 API, MinIO, Ceph, SeaweedFS, R2, GCS
interoperability), through boto3.

Credentials come from boto3's standard chain (the AWS_* environment variables, ~/.aws, an
instance or pod role); the endpoint from `--s3-endpoint`, else AWS_ENDPOINT_URL, else AWS.
boto3 rather than pyarrow's S3FileSystem (installed with Ray): a failed request there is an
OSError whose text holds the status, and its retries happen inside it, blind to Retry-After;
boto3 gives the HTTP status, the S3 error code and the headers, which the retries
(raywds.data.http) and the one-line errors below need. boto3's own retries are off: every
retry is ours, counted, with backoff, resuming at the byte where the last attempt stopped.

    raw = read_bytes("s3://bucket/imagenet/manifest.json", endpoint=None)

    >>> split("s3://bucket/imagenet/manifest.json")  # bucket, key
    ('bucket', 'imagenet/manifest.json')
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import urllib3

from raywds.data.http import TRANSIENT, HttpShard, StoreBusy, size_mismatch
from raywds.errors import DataError, ShardError

SCHEME = "s3://"
TRANSIENT_STATUS = frozenset({500, 502, 503, 504})
TRANSIENT_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling"})


def is_s3(location: str) -> bool:
    return location.startswith(SCHEME)


def split(url: str) -> tuple[str, str]:
    """("bucket", "key/in/it") of s3://bucket/key/in/it; the key may be empty."""
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise DataError(f"{url}: an S3 address is s3://BUCKET/KEY")
    return bucket, key


def endpoint_of(endpoint: str | None) -> str | None:
    """The endpoint a client talks to: the flag's, else AWS_ENDPOINT_URL's, else AWS (None)."""
    return endpoint or os.environ.get("AWS_ENDPOINT_URL") or None


READ_TIMEOUT_S = 60.0
"""How long a read waits for a store that has gone quiet (raywds's clients, and the run store Ray writes through)."""
CONNECT_TIMEOUT_S = 10.0
"""How long a connection may take, at most."""


def client(endpoint: str | None = None, timeout_s: float = READ_TIMEOUT_S) -> Any:
    """One boto3 client per process, endpoint and credentials in the environment (boto3 clients
    are thread-safe; sessions are not). Path-style addressing for any endpoint but AWS's own, as
    MinIO, SeaweedFS and AIStore want."""
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    keys = tuple(os.environ.get(name) for name in names)
    return _client(endpoint_of(endpoint), timeout_s, keys)


@functools.lru_cache(maxsize=8)
def _client(where: str | None, timeout_s: float, keys: tuple[str | None, ...]) -> Any:
    from botocore.config import Config

    config = Config(
        connect_timeout=min(CONNECT_TIMEOUT_S, timeout_s),
        read_timeout=timeout_s,
        retries={"total_max_attempts": 1},
        s3={"addressing_style": "path" if where else "auto"},
    )
    with _making:  # a session is not thread-safe: a loader worker's prefetch thread makes clients too
        return _session(keys).client("s3", endpoint_url=where, config=config)


_making = threading.Lock()


@functools.lru_cache(maxsize=4)
def _session(keys: tuple[str | None, ...]) -> Any:
    """One boto3 session per set of credentials in the environment. It keeps the S3 service model
    it loaded (about 0.5 CPU seconds), which forked loader workers inherit: a client made from it
    in a worker took 0.06 CPU seconds, one from a new session 0.5, in every worker of every epoch."""
    import boto3

    return boto3.session.Session()


# A forked loader worker must not inherit the parent's clients: their kept-alive connections
# would then be read by two processes at once, each taking the other's answers. The sessions
# hold no connection and stay.
def _after_fork() -> None:
    global _making
    _client.cache_clear()
    _making = threading.Lock()  # a thread of the parent may have held it as the child was made


os.register_at_fork(after_in_child=_after_fork)


def errors() -> tuple[type[BaseException], ...]:
    """What a boto3 call raises (imported only when a call is made: `raywds convert` to a folder
    and the loader on local shards never import botocore)."""
    from botocore.exceptions import BotoCoreError, ClientError

    return BotoCoreError, ClientError, OSError


def status_and_code(error: BaseException) -> tuple[int | None, str]:
    """The HTTP status and S3 error code of a boto3 ClientError (None, class name otherwise)."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return None, type(error).__name__
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status, str(response.get("Error", {}).get("Code", ""))


def retry_after_s(error: BaseException) -> float | None:
    """The server's Retry-After, in seconds, on a throttled answer (None when it sent none)."""
    response = getattr(error, "response", None)
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}) if isinstance(response, dict) else {}
    try:
        return float(headers["retry-after"]) if "retry-after" in headers else None
    except ValueError:  # an HTTP date: fall back to our own backoff
        return None


def transient(error: BaseException) -> bool:
    """A failure worth retrying: a throttled or failing server, or a connection that broke."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(error, ClientError):
        status, code = status_and_code(error)
        return status in TRANSIENT_STATUS or code in TRANSIENT_CODES
    credentials = type(error).__name__ in ("NoCredentialsError", "PartialCredentialsError")
    return isinstance(error, (BotoCoreError, OSError)) and not credentials


def error_line(error: BaseException, url: str, endpoint: str | None = None) -> str:
    """One line that names the object, what the store answered and what to do about it."""
    status, code = status_and_code(error)
    where = endpoint_of(endpoint) or "AWS S3"
    bucket, key = split(url)
    if code in ("NoCredentialsError", "PartialCredentialsError"):
        return (
            f"{url}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "or AWS_PROFILE with ~/.aws/credentials, or give the machine a role"
        )
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden"):
        return (
            f"{url}: {where} refused the credentials (HTTP {status} {code}): check AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY (or the profile or role) and that they may read this bucket"
        )
    if code == "NoSuchBucket":
        return (
            f"{url}: bucket {bucket!r} does not exist at {where} (HTTP {status} {code}); "
            "check the bucket name and --s3-endpoint"
        )
    if code in ("NoSuchKey", "404", "NotFound"):
        return (
            f"{url}: no object {key!r} in bucket {bucket!r} at {where} (HTTP 404{' NoSuchKey' * (code == 'NoSuchKey')})"
        )
    if status in TRANSIENT_STATUS or code in TRANSIENT_CODES:
        return (
            f"{url}: {where} answered HTTP {status} {code}: the store is throttling or failing; "
            "raise --read-retries, read with fewer loader workers, or try again later"
        )
    if status is None:
        return f"{url}: cannot reach {where}: {error}; check --s3-endpoint (or AWS_ENDPOINT_URL)"
    return f"{url}: {where} answered HTTP {status} {code}"


def check_bucket(url: str, endpoint: str | None = None) -> None:
    """One line before any work when the bucket is missing or the credentials are refused."""
    bucket, _ = split(url)
    try:
        client(endpoint).head_bucket(Bucket=bucket)
    except errors() as e:
        if status_and_code(e)[0] == 404:  # a HEAD answer has no body, so no NoSuchBucket code
            raise DataError(
                f"{url}: bucket {bucket!r} does not exist at {endpoint_of(endpoint) or 'AWS S3'}; "
                "create it, or check the bucket name and --s3-endpoint"
            ) from None
        raise DataError(error_line(e, url, endpoint)) from None


def read_bytes(url: str, endpoint: str | None = None, timeout_s: float = 30.0) -> bytes:
    """A small object (a manifest) whole; FileNotFoundError when it is not there, DataError otherwise."""
    bucket, key = split(url)
    try:
        return client(endpoint, timeout_s).get_object(Bucket=bucket, Key=key)["Body"].read()  # type: ignore[no-any-return]
    except errors() as e:
        if status_and_code(e)[1] in ("NoSuchKey", "404", "NotFound"):
            raise FileNotFoundError(url) from None
        raise DataError(error_line(e, url, endpoint)) from None


def join(url: str, name: str) -> str:
    """`name` under the prefix `url` (s3://b/runs + x/y -> s3://b/runs/x/y)."""
    return f"{url.rstrip('/')}/{name}"


MULTIPART_BYTES = 64 << 20
"""A file larger than this goes up in parts of this size (boto3's transfer manager)."""


def put_file(
    path: str | os.PathLike[str], url: str, endpoint: str | None = None, metadata: dict[str, str] | None = None
) -> None:
    """Upload one file (boto3's transfer manager: multipart above MULTIPART_BYTES), with the
    object's user `metadata`; DataError in one line."""
    from boto3.exceptions import S3UploadFailedError
    from boto3.s3.transfer import TransferConfig

    bucket, key = split(url)
    transfer = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)
    extra = {"Metadata": metadata} if metadata else None
    try:
        client(endpoint).upload_file(os.fspath(path), bucket, key, ExtraArgs=extra, Config=transfer)
    except (*errors(), S3UploadFailedError) as e:
        cause = e.__context__ if isinstance(e, S3UploadFailedError) and e.__context__ is not None else e
        raise DataError(error_line(cause, url, endpoint)) from None


def recorded(
    url: str, endpoint: str | None = None, timeout_s: float = READ_TIMEOUT_S
) -> tuple[int, dict[str, str]] | None:
    """An object's size and user metadata (a HEAD), or None when it is not there; DataError otherwise."""
    head = _head(url, endpoint, timeout_s)
    return None if head is None else (int(head["ContentLength"]), dict(head.get("Metadata", {})))


def delete(url: str, endpoint: str | None = None) -> None:
    """Remove an object; one that is not there is no error (S3 answers a delete of it with 204)."""
    bucket, key = split(url)
    try:
        client(endpoint).delete_object(Bucket=bucket, Key=key)
    except errors() as e:
        raise DataError(error_line(e, url, endpoint)) from None


def get_file(url: str, path: str | os.PathLike[str], endpoint: str | None = None) -> bool:
    """Download one object to `path`; False when there is no such object, DataError otherwise."""
    bucket, key = split(url)
    try:
        client(endpoint).download_file(bucket, key, os.fspath(path))
    except errors() as e:
        if status_and_code(e)[0] == 404 or status_and_code(e)[1] in ("NoSuchKey", "404", "NotFound"):
            return False
        raise DataError(error_line(e, url, endpoint)) from None
    return True


def put_bytes(data: bytes, url: str, endpoint: str | None = None) -> None:
    """Upload a small object (a manifest) in one request; DataError in one line."""
    bucket, key = split(url)
    try:
        client(endpoint).put_object(Bucket=bucket, Key=key, Body=data)
    except errors() as e:
        raise DataError(error_line(e, url, endpoint)) from None


def stat(url: str, endpoint: str | None = None, timeout_s: float = 30.0) -> tuple[int, str]:
    """An object's (size, ETag); FileNotFoundError when it is not there, DataError otherwise."""
    head = _head(url, endpoint, timeout_s)
    if head is None:
        raise FileNotFoundError(url)
    return int(head["ContentLength"]), str(head.get("ETag", "")).strip('"')


def _head(url: str, endpoint: str | None, timeout_s: float) -> dict[str, Any] | None:
    """An object's HEAD answer, or None when it is not there; DataError otherwise."""
    bucket, key = split(url)
    try:
        return client(endpoint, timeout_s).head_object(Bucket=bucket, Key=key)  # type: ignore[no-any-return]
    except errors() as e:
        if status_and_code(e)[0] == 404 or status_and_code(e)[1] in ("NoSuchKey", "404", "NotFound"):
            return None
        raise DataError(error_line(e, url, endpoint)) from None


def listing(prefix: str, endpoint: str | None = None) -> list[tuple[str, int, str]]:
    """(s3:// URL, size, ETag) of every object under `prefix`, in name order."""
    bucket, key = split(prefix)
    found: list[tuple[str, int, str]] = []
    try:
        for page in client(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
            for item in page.get("Contents", []):
                found.append((f"{SCHEME}{bucket}/{item['Key']}", int(item["Size"]), str(item["ETag"]).strip('"')))
    except errors() as e:
        raise DataError(error_line(e, prefix, endpoint)) from None
    return found


class Partial:
    """urllib3's response read as http.client's is: what has arrived, not a full buffer, so the
    bytes before a broken connection count and the retry resumes after them."""

    def __init__(self, raw: Any):
        self.raw = raw

    def readinto(self, buffer: Any) -> int:
        data = self.raw.read1(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class S3Shard(HttpShard):
    """An s3:// shard: one streaming GET from the byte it needs (`Range: bytes=POS-`), resumed
    the same way after a dropped connection or a throttled (503 SlowDown) or failing (5xx)
    store, after the store's Retry-After when it sends one, else the usual backoff."""

    transient = (*TRANSIENT, urllib3.exceptions.HTTPError)

    def _connect(self) -> None:
        bucket, key = split(self.url)
        where = self.policy.s3_endpoint
        try:
            answer = client(where, self.policy.read_timeout_s).get_object(
                Bucket=bucket, Key=key, **({"Range": f"bytes={self.pos}-"} if self.pos else {})
            )
        except errors() as e:
            if transient(e):
                raise StoreBusy(error_line(e, self.url, where), retry_after_s(e)) from None
            raise ShardError(f"shard {error_line(e, self.url, where)}") from None
        if self.size is not None and not self.pos and int(answer["ContentLength"]) != self.size:
            answer["Body"].close()
            raise size_mismatch(self.url, int(answer["ContentLength"]), self.size)
        if self.size is None:
            self.size = self.pos + int(answer["ContentLength"])
        self._conn, self._response = answer["Body"], Partial(answer["Body"]._raw_stream)  # type: ignore[assignment]

    def _wait_s(self, cause: BaseException) -> float:
        after = getattr(cause, "retry_after_s", None)
        return after if after is not None else super()._wait_s(cause)
