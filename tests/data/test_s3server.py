"""The tests' S3 server (tests/support/s3server.py, SeaweedFS) and fault proxy (tests/support/s3proxy.py) behave as
S3 does where raywds's S3 reader leans on it: SigV4 enforced, S3's error codes, ranged GETs,
multipart uploads; and the proxy's faults reach boto3 as a real SlowDown or reset would."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import boto3
import pytest
import urllib3
from botocore.exceptions import ClientError, ResponseStreamingError
from support.s3proxy import S3Proxy
from support.s3server import S3Server

NO_RETRIES = {"total_max_attempts": 1}


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[S3Proxy]:
    """A fault proxy in front of this test's bucket, faulting GETs of .tar keys only."""
    with S3Proxy(s3, path=r"\.tar$") as p:
        yield p


def error_of(e: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    return e.value.response["Error"]["Code"], e.value.response["ResponseMetadata"]["HTTPStatusCode"]


def test_put_and_get_through_the_aws_variables(s3: S3Server) -> None:
    s3.client().put_object(Bucket=s3.bucket, Key="a/b.tar", Body=b"shard bytes")
    assert os.environ["AWS_ENDPOINT_URL"] == s3.endpoint
    client = boto3.client("s3")  # nothing but the environment the fixture set
    assert client.get_object(Bucket=s3.bucket, Key="a/b.tar")["Body"].read() == b"shard bytes"
    assert [o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket)["Contents"]] == ["a/b.tar"]
    assert s3.url("a/b.tar") == f"s3://{s3.bucket}/a/b.tar"


def test_signatures_are_checked(s3: S3Server) -> None:
    s3.client().put_object(Bucket=s3.bucket, Key="a.tar", Body=b"x")
    wrong_secret = dataclasses.replace(s3, secret_key=s3.secret_key[::-1]).client(retries=NO_RETRIES)
    with pytest.raises(ClientError, match="SignatureDoesNotMatch") as e:
        wrong_secret.get_object(Bucket=s3.bucket, Key="a.tar")
    assert error_of(e) == ("SignatureDoesNotMatch", 403)
    unknown_key = dataclasses.replace(s3, access_key="AKUNKNOWN0000000").client(retries=NO_RETRIES)
    with pytest.raises(ClientError, match="InvalidAccessKeyId") as e:
        unknown_key.get_object(Bucket=s3.bucket, Key="a.tar")
    assert error_of(e) == ("InvalidAccessKeyId", 403)


def test_missing_bucket_and_key(s3: S3Server) -> None:
    client = s3.client(retries=NO_RETRIES)
    with pytest.raises(ClientError, match="NoSuchBucket") as e:
        client.get_object(Bucket=s3.bucket + "-missing", Key="a.tar")
    assert error_of(e) == ("NoSuchBucket", 404)
    with pytest.raises(ClientError, match="NoSuchKey") as e:
        client.get_object(Bucket=s3.bucket, Key="missing.tar")
    assert error_of(e) == ("NoSuchKey", 404)


def test_ranged_get(s3: S3Server) -> None:
    data = bytes(range(256)) * 40
    client = s3.client()
    client.put_object(Bucket=s3.bucket, Key="a.tar", Body=data)
    response = client.get_object(Bucket=s3.bucket, Key="a.tar", Range="bytes=1000-1999")
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert response["ContentRange"] == f"bytes 1000-1999/{len(data)}"
    assert response["Body"].read() == data[1000:2000]


def test_multipart_upload(s3: S3Server) -> None:
    client = s3.client()
    parts = [os.urandom(5 * 1024 * 1024), b"tail"]  # S3's smallest part but the last: 5 MiB
    upload = client.create_multipart_upload(Bucket=s3.bucket, Key="big.tar")["UploadId"]
    etags = [
        client.upload_part(Bucket=s3.bucket, Key="big.tar", UploadId=upload, PartNumber=i, Body=part)["ETag"]
        for i, part in enumerate(parts, 1)
    ]
    client.complete_multipart_upload(
        Bucket=s3.bucket,
        Key="big.tar",
        UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": i, "ETag": etag} for i, etag in enumerate(etags, 1)]},
    )
    head = client.head_object(Bucket=s3.bucket, Key="big.tar")
    assert head["ContentLength"] == len(parts[0]) + 4
    assert head["ETag"].endswith('-2"')  # S3's multipart ETag: md5 of the parts' md5s, then -count
    tail = client.get_object(Bucket=s3.bucket, Key="big.tar", Range=f"bytes={len(parts[0]) - 2}-")["Body"].read()
    assert tail == parts[0][-2:] + b"tail"


def test_proxy_forwards_requests_unchanged(s3: S3Server, proxy: S3Proxy) -> None:
    client = proxy.server.client(retries=NO_RETRIES)  # signed for the proxy's Host, checked upstream
    client.put_object(Bucket=s3.bucket, Key="a.tar", Body=b"0123456789")
    response = client.get_object(Bucket=s3.bucket, Key="a.tar", Range="bytes=2-5")
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert response["Body"].read() == b"2345"
    assert [o["Key"] for o in client.list_objects_v2(Bucket=s3.bucket)["Contents"]] == ["a.tar"]
    assert proxy.log == [
        ("PUT", f"/{s3.bucket}/a.tar", None),
        ("GET", f"/{s3.bucket}/a.tar", "bytes=2-5"),
        ("GET", f"/{s3.bucket}", None),
    ]
    assert (proxy.num_requests, proxy.num_matching_gets, proxy.num_slowdowns, proxy.num_resets) == (3, 1, 0, 0)


def test_slowdown(s3: S3Server, proxy: S3Proxy) -> None:
    s3.client().put_object(Bucket=s3.bucket, Key="a.tar", Body=b"x")
    client = proxy.server.client(retries=NO_RETRIES)
    proxy.slowdown_every = 2
    assert client.get_object(Bucket=s3.bucket, Key="a.tar")["Body"].read() == b"x"
    with pytest.raises(ClientError, match="SlowDown") as e:
        client.get_object(Bucket=s3.bucket, Key="a.tar")
    assert error_of(e) == ("SlowDown", 503)
    assert e.value.response["Error"]["Message"] == "Please reduce your request rate."
    assert e.value.response["ResponseMetadata"]["HTTPHeaders"]["retry-after"] == "0"
    assert (proxy.num_matching_gets, proxy.num_slowdowns) == (2, 1)


def test_reset_mid_body(s3: S3Server, proxy: S3Proxy) -> None:
    data = os.urandom(2_000_000)
    s3.client().put_object(Bucket=s3.bucket, Key="a.tar", Body=data)
    client = proxy.server.client(retries=NO_RETRIES)
    proxy.reset_every = 1
    proxy.reset_after_bytes = 65536
    response = client.get_object(Bucket=s3.bucket, Key="a.tar")
    assert response["ContentLength"] == len(data)  # the headers come whole
    got = b""
    with pytest.raises(ResponseStreamingError, match="Connection reset by peer") as e:
        for chunk in response["Body"].iter_chunks(4096):
            got += chunk
    assert got == data[:65536]
    assert isinstance(e.value.kwargs["error"], urllib3.exceptions.ProtocolError)
    proxy.reset_every = 0
    assert client.get_object(Bucket=s3.bucket, Key="a.tar")["Body"].read() == data  # on a new connection
    assert (proxy.num_matching_gets, proxy.num_resets) == (2, 1)


def test_fault_counts_add_up(s3: S3Server, proxy: S3Proxy) -> None:
    writer = s3.client()
    writer.put_object(Bucket=s3.bucket, Key="a.tar", Body=b"tar")
    writer.put_object(Bucket=s3.bucket, Key="a.json", Body=b"{}")
    client = proxy.server.client(retries=NO_RETRIES)
    proxy.slowdown_every, proxy.reset_every, proxy.reset_after_bytes = 3, 2, 1
    outcomes = []
    for _ in range(6):  # the 2nd and 4th reset, the 3rd and 6th (2 and 3 divide 6: SlowDown first) slowed
        try:
            outcomes.append(client.get_object(Bucket=s3.bucket, Key="a.tar")["Body"].read().decode())
        except ClientError as e:
            outcomes.append(e.response["Error"]["Code"])
        except ResponseStreamingError:
            outcomes.append("reset")
        assert client.get_object(Bucket=s3.bucket, Key="a.json")["Body"].read() == b"{}"  # never faulted
    client.head_object(Bucket=s3.bucket, Key="a.tar")
    assert outcomes == ["tar", "reset", "SlowDown", "reset", "tar", "SlowDown"]
    assert (proxy.num_requests, proxy.num_matching_gets, proxy.num_slowdowns, proxy.num_resets) == (13, 6, 2, 2)
    assert len(proxy.log) == 13 and proxy.log[-1] == ("HEAD", f"/{s3.bucket}/a.tar", None)
