"""gs:// against a real Google Cloud Storage emulator (fake-gcs-server, tests/support/gcsserver.py),
found as Google's own clients find one, through STORAGE_EMULATOR_HOST: reads, listings and writes,
a shard read resumed at the byte through a proxy that cuts it (tests/support/s3proxy.py), `raywds
index` of a prefix and of a brace list, training from a bucket, anonymous reads, the one-line errors."""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.data import check_a_bucket_holds_its_own_shards_only
from support.gcsserver import GcsServer, gcs_server
from support.runs import SUMMARY, command
from support.s3proxy import S3Proxy

from raywds.data import gcs, shardlists, stores
from raywds.data.convert import ConvertOptions, convert
from raywds.data.http import PIECE, ReadPolicy
from raywds.data.manifest import read_manifest
from raywds.data.stores import Storage
from raywds.errors import DataError, ShardError, ShardMismatch

NOT_TWO_SLASHES = re.compile(r"gs:/(?!/)")
"""A gs:// URL that went through pathlib (`gs:/bucket/...`): the bug where a URL is a folder."""


@pytest.fixture(scope="module")
def gcs_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    """One emulator for this file's tests: ~0.03 s to start, ~30 MiB resident."""
    with gcs_server(tmp_path_factory.mktemp("gcs"), buckets=()) as server:
        yield server


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A test's own bucket in the emulator."""

    server: GcsServer
    name: str

    def url(self, key: str = "") -> str:
        return self.server.url(self.name, key)

    def put(self, key: str, data: bytes) -> None:
        self.server.put(self.name, key, data)

    def get(self, key: str) -> bytes:
        return self.server.get(self.name, key)


@pytest.fixture
def bucket(gcs_session: GcsServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    """A fresh bucket of this test's own; raywds finds the emulator through STORAGE_EMULATOR_HOST
    (set here; the user's own Google credentials variable unset), with no credentials cached."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    gcs_session.create_bucket(name)
    monkeypatch.setenv(gcs.EMULATOR, gcs_session.endpoint)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    gcs._credentials.cache_clear()
    yield Bucket(gcs_session, name)
    gcs._credentials.cache_clear()


def raywds(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The command line as a user runs it, in this test's environment (the emulator's variable)."""
    return subprocess.run(
        [sys.executable, "-m", "raywds", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def error_line(run: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command printed; fails the test on a traceback or several lines."""
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


def upload(bucket: Bucket, prefix: str, files: list[Path], names: list[str] | None = None) -> list[str]:
    """`files` under `prefix/` (as `names`, else their own); their gs:// URLs."""
    urls = []
    for path, name in zip(files, names or [p.name for p in files]):
        bucket.put(f"{prefix}/{name}", path.read_bytes())
        urls.append(bucket.url(f"{prefix}/{name}"))
    return urls


# --- reads, listings, writes ---------------------------------------------------------------------


def test_read_stat_list_and_write_round_trip(bucket: Bucket) -> None:
    """What raywds writes the emulator holds, and what the emulator holds raywds reads, lists
    (every object under the prefix, nested ones too, in name order) and stats (size, and an
    etag that changes with the bytes); keys that need quoting in a URL are found."""
    manifest = bucket.url("m/manifest.json")
    Storage().write(manifest, b'{"format": 1}\n')
    assert bucket.get("m/manifest.json") == b'{"format": 1}\n'
    assert Storage().read(manifest) == b'{"format": 1}\n'
    objects = {"m/a.tar": 1000, "m/b.tar": 10, "m/sub/c.tar": 3, "m/odd name+1%.tar": 7, "m/readme.txt": 5}
    for key, size in objects.items():
        bucket.put(key, bytes(size))
    bucket.put("other/d.tar", b"x")
    assert Storage().read(bucket.url("m/odd name+1%.tar")) == bytes(7)

    size, etag = Storage().stat(bucket.url("m/a.tar"))
    assert size == 1000 and etag
    bucket.put("m/a.tar", b"\1" * 1000)
    size, changed = Storage().stat(bucket.url("m/a.tar"))
    assert size == 1000 and changed and changed != etag

    found = Storage().listing(bucket.url("m/"))
    assert [url for url, _, _ in found] == sorted(bucket.url(k) for k in [*objects, "m/manifest.json"])
    assert dict((url, size) for url, size, _ in found)[bucket.url("m/sub/c.tar")] == 3
    assert all(stamp for _, _, stamp in found)
    shards = [bucket.url(k) for k in sorted(objects) if k.endswith(".tar")]
    assert shardlists.expand([bucket.url("m/")]) == shards  # a prefix: its .tar objects only
    assert shardlists.expand([bucket.url("m/{a,b}.tar"), bucket.url("other/")]) == [
        bucket.url("m/a.tar"),
        bucket.url("m/b.tar"),
        bucket.url("other/d.tar"),
    ]
    assert shardlists.expand([bucket.url("m/[ab].tar")]) == [bucket.url("m/a.tar"), bucket.url("m/b.tar")]


def test_missing_objects_and_buckets(bucket: Bucket) -> None:
    """A missing object is FileNotFoundError (so a missing manifest reads as one); a missing bucket
    to write into and a malformed address are DataErrors naming them."""
    with pytest.raises(FileNotFoundError, match=re.escape(bucket.url("nope/manifest.json"))):
        Storage().read(bucket.url("nope/manifest.json"))
    with pytest.raises(FileNotFoundError):
        Storage().stat(bucket.url("nope/a.tar"))
    assert Storage().listing(bucket.url("nope/")) == []
    with pytest.raises(DataError, match=r"nope/: names no shard \(no \.tar file there\)"):
        shardlists.expand([bucket.url("nope/")])
    with pytest.raises(DataError, match=rf"bucket '{bucket.name}-gone' does not exist at http://127\.0\.0\.1:\d+$"):
        Storage().write(f"gs://{bucket.name}-gone/m/manifest.json", b"{}")
    with pytest.raises(DataError, match=r"gs:///k: a Google Cloud Storage address is gs://BUCKET/KEY"):
        Storage().read("gs:///k")
    line = gcs.error_line(bucket.url("k"), 404, "")
    assert line == f"{bucket.url('k')}: no object 'k' in bucket '{bucket.name}' at {bucket.server.endpoint} (HTTP 404)"


def test_a_listing_of_more_than_a_page_gets_every_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1,005 objects: the JSON API answers 1,000 and a page token; raywds follows it to the rest."""
    names = {f"p/shard-{i:05d}.tar": b"x" for i in range(1005)}
    with gcs_server(tmp_path, buckets=(), preload={"many": names}) as server:
        first = json.loads(server.request("GET", "/storage/v1/b/many/o?prefix=p/&maxResults=1000"))
        assert len(first["items"]) == 1000 and first["nextPageToken"]
        monkeypatch.setenv(gcs.EMULATOR, server.endpoint)
        assert shardlists.expand(["gs://many/p/"]) == [f"gs://many/{name}" for name in sorted(names)]


# --- shard reads ---------------------------------------------------------------------------------


def cut_read(bucket: Bucket, monkeypatch: pytest.MonkeyPatch, size: int, cut_at: int) -> tuple[list[str | None], int]:
    """Read a `size`-byte shard through a proxy that resets its media GET after `cut_at` bytes
    (the metadata GET before it passes): checks every byte came, and gives the GETs' Range
    headers and the retries counted."""
    data = random.Random(size).randbytes(size)
    bucket.put("s/x.tar", data)
    url = bucket.url("s/x.tar")
    policy = ReadPolicy(read_timeout_s=5.0, retries=3, backoff_s=0.01)
    with S3Proxy(bucket.server, path=r"/s%2Fx\.tar$") as proxy:  # type: ignore[arg-type]  # it needs .endpoint only
        monkeypatch.setenv(gcs.EMULATOR, proxy.endpoint)
        proxy.reset_every, proxy.reset_after_bytes = 2, cut_at
        assert Storage().stat(url)[0] == size
        retries: list[int] = []
        with stores.open_shard(url, policy, size=size, retried=lambda: retries.append(1)) as stream:
            assert stream.read() == data
    monkeypatch.setenv(gcs.EMULATOR, bucket.server.endpoint)
    assert proxy.num_resets == 1, proxy.log
    return [r for method, _, r in proxy.log if method == "GET"], len(retries)


def test_a_shard_read_gets_its_exact_bytes_and_resumes_after_a_cut(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cut after 1.5 MB of 2.5: one retry, counted, a Range request from where the bytes the
    reader had taken stopped (its first 1 MiB piece), and the shard's exact bytes."""
    ranges, retries = cut_read(bucket, monkeypatch, 2_500_000, 1_500_000)
    assert retries == 1 and len(ranges) == 3 and ranges[:2] == [None, None], ranges
    resumed_at = int(str(ranges[2]).removeprefix("bytes=").rstrip("-"))
    assert resumed_at == PIECE, ranges  # the first whole piece kept, the cut one read again


def test_a_cut_inside_the_first_piece_reads_that_piece_again(bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut after 200 KB of 1 MB, inside the reader's first piece (raywds.data.http.PIECE, 1 MiB):
    http.client drops a piece cut short, so the one retry asks for the shard from that piece's
    start (byte 0: no Range), and the bytes are still exact (cut_read checks them)."""
    ranges, retries = cut_read(bucket, monkeypatch, 1_000_000, 200_000)
    assert retries == 1 and len(ranges) == 3 and ranges[1:] == [None, None], ranges
    assert PIECE > 200_000


def test_a_missing_shard_and_one_of_another_size_name_it(bucket: Bucket) -> None:
    bucket.put("s/x.tar", bytes(5000))
    policy = ReadPolicy(read_timeout_s=5.0, retries=1, backoff_s=0.01)
    with stores.open_shard(bucket.url("s/x.tar"), policy) as stream:
        assert stream.read() == bytes(5000)
    with pytest.raises(ShardError, match=rf"^shard {re.escape(bucket.url('s/y.tar'))}: no object 's/y.tar' in bucket"):
        stores.open_shard(bucket.url("s/y.tar"), policy)
    with pytest.raises(ShardMismatch, match=r"is 5000 bytes, its manifest entry 5001: it changed after"):
        stores.open_shard(bucket.url("s/x.tar"), policy, size=5001)


# --- raywds index --------------------------------------------------------------------------------


def test_index_a_prefix_and_a_brace_list_writes_the_manifest_beside_the_shards(bucket: Bucket, uneven: Path) -> None:
    """Shards webdataset's TarWriter wrote (no raywds manifest in the bucket): `raywds index
    gs://B/foreign/` splits them by name and writes gs://B/foreign/manifest.json, which reads back
    with no `shards_at`; a brace list indexes exactly the shards it names."""
    train = sorted(uneven.glob("uneven-train-*.tar"))
    val = sorted(uneven.glob("*-val-*.tar"))
    assert len(train) == 9 and len(val) == 4
    upload(bucket, "foreign", [*train, *val])

    run = raywds("index", bucket.url("foreign/"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "train: 120 samples in 9 shards" in run.stdout and "val: 50 samples in 4 shards" in run.stdout, run.stdout
    assert f"raywds: wrote {bucket.url('foreign/manifest.json')} (10 classes;" in run.stdout, run.stdout
    written = json.loads(bucket.get("foreign/manifest.json"))
    assert "shards_at" not in written and written["made_by"]["tool"] == "raywds index"
    manifest = read_manifest(bucket.url("foreign"))
    assert (manifest.num_samples("train"), manifest.num_samples("val")) == (120, 50)
    assert [s.name for s in manifest.shards("train")] == [p.name for p in train]

    upload(bucket, "brace", train[:4], [f"x-{i:04d}.tar" for i in range(4)])
    run = raywds("index", bucket.url("brace/x-{0000..0002}.tar"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "train: 38 samples in 3 shards" in run.stdout, run.stdout  # 1 + 30 + 7: x-0003 left out
    manifest = read_manifest(bucket.url("brace"))
    assert [s.name for s in manifest.shards("train")] == ["x-0000.tar", "x-0001.tar", "x-0002.tar"]
    assert NOT_TWO_SLASHES.search(run.stdout + run.stderr) is None


# --- training from a bucket ----------------------------------------------------------------------

TRAIN = [
    "train",
    "--recipe",
    "demo",
    "--image-size",
    "32",
    "--batch-size",
    "16",
    "--epochs",
    "1",
    "--loader-workers",
    "1",
    "--mode",
    "split",
]


def samples_seen(run: subprocess.CompletedProcess[str]) -> int:
    """The run's summary line's `samples seen` (the doctor's lines may follow it)."""
    assert run.returncode == 0, run.stderr[-3000:]
    match = SUMMARY.search(run.stdout)
    assert match, run.stdout[-2000:]
    return int(match[4])


@pytest.mark.slow
def test_train_from_converted_shards_in_a_bucket(bucket: Bucket, shards: Path, tmp_path: Path) -> None:
    """raywds's own shards and manifest, uploaded as they are: a split epoch sees each of the 120
    training samples once."""
    bucket.server.upload_folder(bucket.name, "converted", shards)
    run = command(
        [sys.executable, "-m", "raywds", *TRAIN, "--data", bucket.url("converted"), "--out", str(tmp_path / "run")]
    )
    assert samples_seen(run) == 1 * 120


@pytest.mark.slow
def test_train_from_foreign_shards_named_by_a_brace_url(bucket: Bucket, uneven: Path, tmp_path: Path) -> None:
    """Shards raywds did not write, with no manifest, named as WebDataset users name them: indexed
    once into the index cache, then a split epoch of their 120 samples."""
    upload(bucket, "foreign", sorted(uneven.glob("*.tar")))
    run = command(
        [
            sys.executable,
            "-m",
            "raywds",
            *TRAIN,
            "--data",
            bucket.url("foreign/uneven-train-{000000..000008}.tar"),
            "--val-data",
            bucket.url("foreign/") + "*-val-*.tar",
            "--out",
            str(tmp_path / "run"),
        ],
        RAYWDS_INDEX_CACHE=str(tmp_path / "index"),
    )
    assert samples_seen(run) == 1 * 120
    assert len(list((tmp_path / "index").glob("*/manifest.json"))) == 1


# --- credentials ---------------------------------------------------------------------------------


class Recorder:
    """A small HTTP server on 127.0.0.1 that records each request's method, path and headers and
    either forwards it to `upstream` or answers `answer` (status, JSON body) itself."""

    def __init__(self, upstream: str | None = None, answer: tuple[int, dict[str, object]] | None = None) -> None:
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def handle_any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.requests.append((self.command, self.path, dict(self.headers.items()), body))
                if answer is not None:
                    status, text = answer[0], json.dumps(answer[1]).encode()
                else:
                    assert upstream is not None
                    request = urllib.request.Request(upstream + self.path, data=body or None, method=self.command)
                    try:
                        with urllib.request.urlopen(request, timeout=10) as response:
                            status, text = response.status, response.read()
                    except urllib.error.HTTPError as e:
                        status, text = e.code, e.read()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            do_GET = do_POST = handle_any

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> Recorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def adc_file(folder: Path, token_uri: str) -> Path:
    """An Application Default Credentials file: a service account's key (a fresh RSA key), whose
    token requests go to `token_uri`. (A user's file, as `gcloud auth application-default login`
    writes it, cannot be pointed elsewhere: google-auth always sends it to Google's endpoint.)"""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    path = folder / f"sa-{uuid.uuid4().hex[:8]}.json"
    info = {
        "type": "service_account",
        "project_id": "raywds-test",
        "private_key_id": "k1",
        "private_key": pem,
        "client_email": "reader@raywds-test.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }
    path.write_text(json.dumps(info))
    return path


def test_an_emulator_gets_no_authorization_even_with_credentials_at_hand(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STORAGE_EMULATOR_HOST set and a service account's key in GOOGLE_APPLICATION_CREDENTIALS: raywds
    asks for no token and sends no Authorization header, on any request (as Google's clients do)."""
    bucket.put("pub/a.tar", b"a" * 3000)
    with Recorder(answer=(200, {"access_token": "tok-1", "expires_in": 3600})) as tokens:
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc_file(tmp_path, tokens.endpoint + "/token")))
        with Recorder(upstream=bucket.server.endpoint) as recorder:
            monkeypatch.setenv(gcs.EMULATOR, recorder.endpoint.removeprefix("http://"))  # host:port, as gcloud sets it
            assert gcs.headers() == {}
            assert Storage().stat(bucket.url("pub/a.tar"))[0] == 3000
            assert shardlists.expand([bucket.url("pub/")]) == [bucket.url("pub/a.tar")]
            with stores.open_shard(bucket.url("pub/a.tar"), ReadPolicy()) as stream:
                assert stream.read() == b"a" * 3000
            Storage().write(bucket.url("pub/manifest.json"), b"{}")
    assert len(recorder.requests) == 4 and not tokens.requests
    assert not [h for _, _, headers, _ in recorder.requests for h in headers if h.lower() == "authorization"]


def test_application_default_credentials_give_a_bearer_token_refreshed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No emulator, a service account's key in GOOGLE_APPLICATION_CREDENTIALS: the token comes
    from its token_uri once (a signed JWT exchanged) and is reused; a token endpoint that refuses
    is one line saying what to run."""
    monkeypatch.delenv(gcs.EMULATOR, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    gcs._credentials.cache_clear()
    try:
        with Recorder(answer=(200, {"access_token": "tok-1", "expires_in": 3600})) as tokens:
            monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc_file(tmp_path, tokens.endpoint + "/token")))
            assert gcs.headers() == {"Authorization": "Bearer tok-1"}
            assert gcs.headers() == {"Authorization": "Bearer tok-1"}
        assert [(method, path) for method, path, _, _ in tokens.requests] == [("POST", "/token")]
        assert b"grant_type=urn%3Aietf%3Aparams%3Aoauth%3Agrant-type%3Ajwt-bearer" in tokens.requests[0][3]
        line = gcs.error_line("gs://b/k", 403, "")
        assert "refused the Application Default Credentials (HTTP 403)" in line and line.startswith("gs://b/k: ")

        gcs._credentials.cache_clear()
        with Recorder(answer=(400, {"error": "invalid_grant", "error_description": "Invalid JWT"})) as refusing:
            monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc_file(tmp_path, refusing.endpoint + "/token")))
            with pytest.raises(DataError, match=r"cannot get a token from the Application Default Credentials \("):
                gcs.headers()
    finally:
        gcs._credentials.cache_clear()


def test_without_any_credentials_requests_go_out_anonymously(tmp_path: Path) -> None:
    """No emulator, no GOOGLE_APPLICATION_CREDENTIALS, an empty HOME (no gcloud ADC file) and a
    metadata server that refuses at once: no Authorization header (a public bucket's read), and
    a 403 says anonymous requests were refused and what to run. In a fresh process: google-auth
    reads the metadata server's address when first imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "CLOUDSDK_", "STORAGE_EMULATOR"))}
    env.update(
        HOME=str(tmp_path),
        GCE_METADATA_HOST="127.0.0.1:1",
        GCE_METADATA_IP="127.0.0.1:1",
        GCE_METADATA_DETECT_RETRIES="1",
    )
    code = "from raywds.data import gcs; print(gcs.headers()); print(gcs.error_line('gs://b/k', 403, ''))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    headers, line = run.stdout.splitlines()
    assert headers == "{}"
    assert line == (
        "gs://b/k: https://storage.googleapis.com refused anonymous requests (HTTP 403): for a private bucket "
        "run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
    )


def test_a_bucket_that_refuses_anonymous_reads_is_one_line(bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    with Recorder(answer=(403, {"error": {"code": 403, "message": "Anonymous caller does not have access"}})) as store:
        monkeypatch.setenv(gcs.EMULATOR, store.endpoint)
        with pytest.raises(DataError, match=r"refused anonymous requests \(HTTP 403\): for a private bucket run"):
            read_manifest("gs://private/ds")
        with pytest.raises(ShardError, match=r"^shard gs://private/ds/a\.tar: http://127\.0\.0\.1:\d+ refused anon"):
            stores.open_shard("gs://private/ds/a.tar", ReadPolicy())


# --- the command line's one-line errors ----------------------------------------------------------


@pytest.mark.slow
def test_data_with_neither_a_manifest_nor_shards_is_one_line_that_keeps_gs(bucket: Bucket) -> None:
    bucket.put("elsewhere/readme.txt", b"not a shard")
    train = error_line(raywds("train", "--data", bucket.url("nothing"), "--epochs", "1"))
    assert f"no manifest at {bucket.url('nothing/manifest.json')}: run `raywds convert SRC" in train, train
    assert f"raywds convert SRC {bucket.url('nothing')}" in train, train
    index = error_line(raywds("index", bucket.url("elsewhere/")))
    assert index == f"raywds: error: {bucket.url('elsewhere/')}: names no shard (no .tar file there); " + (
        "check the path, the braces or the prefix"
    )
    glob = error_line(raywds("index", bucket.url("elsewhere/*.tar")))
    assert f"{bucket.url('elsewhere/*.tar')}: names no shard" in glob
    for line in (train, index, glob):
        assert NOT_TWO_SLASHES.search(line) is None, line


# --- bugs ----------------------------------------------------------------------------------------


def test_convert_into_a_gs_prefix_uploads_the_shards_and_the_manifest_last(
    bucket: Bucket, tree: Path, tmp_path: Path
) -> None:
    """convert into gs:// as into s3:// (it once wrote ./gs:/B/ds/ and said `wrote gs://B/ds/manifest.json`):
    staged, uploaded with each shard's sha256 in its metadata, read back, the manifest last; `verify`
    then reads every shard from the bucket, and a second run finds them all there."""
    args = ["convert", str(tree), bucket.url("ds"), "--maxcount", "40", "--staging", str(tmp_path / "stage")]
    first = subprocess.run(
        [sys.executable, "-m", "raywds", *args], capture_output=True, text=True, timeout=180, cwd=tmp_path, check=False
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"raywds: wrote {bucket.url('ds/manifest.json')} (10 classes)" in first.stdout
    assert not (tmp_path / "gs:").exists()
    manifest = read_manifest(bucket.url("ds"))
    shards = [s.name for split in manifest.splits for s in manifest.shards(split)]
    held = set(bucket.server.names(bucket.name))
    written = {"ds/manifest.json", "ds/manifest.npz", "ds/_info.json", "ds/sources.npz"}
    assert {f"ds/{name}" for name in shards} | written == held
    sha = json.loads(bucket.server.get(bucket.name, "ds/manifest.json"))["splits"]["train"]["shards"][0]
    assert gcs.metadata(bucket.url(f"ds/{sha['name']}"))["metadata"] == {"sha256": sha["sha256"]}  # type: ignore[index]
    checked = raywds("verify", bucket.url("ds"))
    assert (
        checked.returncode == 0 and f"{len(shards)} shards in {bucket.url('ds')} match the manifest" in checked.stdout
    )
    again = raywds(*args)
    assert again.returncode == 0 and f"the bucket held {len(shards)} of these shards already" in again.stdout


def test_a_bucket_holds_a_shard_at_its_size_with_the_sha256_put_with_it(bucket: Bucket, tmp_path: Path) -> None:
    """What an upload skips: an object of the shard's size whose metadata holds the shard's sha256."""
    where, gone = bucket.url("held/a.tar"), f"gs://{bucket.name}-gone/x/"
    check_a_bucket_holds_its_own_shards_only(where, tmp_path, lambda data: bucket.put("held/a.tar", data), gone)


@pytest.mark.slow
def test_a_missing_bucket_is_one_line(bucket: Bucket) -> None:
    gone = f"gs://{bucket.name}-gone/x/"
    for run in (raywds("index", gone), raywds("train", "--data", gone.rstrip("/"), "--epochs", "1")):
        line = error_line(run)
        assert f"bucket '{bucket.name}-gone'" in line and "does not exist" in line, line


def test_a_bucket_glob_star_stays_in_its_folder_as_a_local_one_does(bucket: Bucket, tmp_path: Path) -> None:
    """`shards/*.tar` locally and `gsutil ls gs://B/shards/*.tar` name the folder's own shards,
    not those of shards/old/ (an earlier version kept below it); `**` is for every level."""
    for key in ("m/a.tar", "m/b.tar", "m/old/a.tar"):
        bucket.put(key, b"x")
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(b"x")
    assert shardlists.expand([str(tmp_path / "m" / "*.tar")]) == [str(tmp_path / "m" / n) for n in ("a.tar", "b.tar")]
    assert shardlists.expand([bucket.url("m/*.tar")]) == [bucket.url("m/a.tar"), bucket.url("m/b.tar")]


def flat_val_tree(tree: Path, out: Path) -> Path:
    """The tree with its val/ flat, labelled by Kaggle's LOC_val_solution.csv beside it (in ROOT)."""
    shutil.copytree(tree / "train", out / "train")
    rows = ["ImageId,PredictionString"]
    (out / "val").mkdir()
    for path in sorted((tree / "val").rglob("*.JPEG")):
        shutil.copy(path, out / "val" / path.name)
        rows.append(f"{path.stem},{path.parent.name} 1 2 3 4")
    (out / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    return out


def test_convert_from_a_gs_prefix_writes_the_shards_a_local_copy_gives(
    bucket: Bucket, tree: Path, tmp_path: Path
) -> None:
    """An image tree in a bucket (here with a flat val/ and Kaggle's labels file beside it) is listed
    once and read object by object: the same shards, byte for byte, as from a local copy."""
    local = flat_val_tree(tree, tmp_path / "tree")
    bucket.server.upload_folder(bucket.name, "images", local)
    here, there = tmp_path / "from-folder", tmp_path / "from-bucket"
    convert(local, here, ConvertOptions(maxcount=40, seed=5))
    out = raywds("convert", bucket.url("images"), str(there), "--maxcount", "40", "--seed", "5")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "val: 50 samples in 2 shards (flat val, labels from LOC_val_solution.csv)" in out.stdout
    assert sorted(p.name for p in there.glob("*.tar")) == sorted(p.name for p in here.glob("*.tar"))
    for shard in here.glob("*.tar"):
        assert (there / shard.name).read_bytes() == shard.read_bytes(), shard.name
    made = json.loads((there / "manifest.json").read_text())
    assert made.pop("source") == bucket.url("images")
    expected = json.loads((here / "manifest.json").read_text())
    expected.pop("source")
    assert made == expected
