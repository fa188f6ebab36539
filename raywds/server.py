"""Serve a shard directory over HTTP: Docker nginx, else local nginx, else an embedded server.

    with ShardServer("shards/") as server:       # backend="auto"
        print(server.url)                         # http://127.0.0.1:PORT
        ...                                       # stopped and cleaned up on exit

    raywds serve shards/ --backend nginx --port 8080
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from raywds.errors import ServerError

BACKENDS = ("auto", "docker", "nginx", "embedded")
DOCKER_IMAGE = "nginx:stable"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def nginx_conf(*, root: str, host: str, port: int, run_dir: str) -> str:
    """One config for the local binary and the Docker image: foreground, files under run_dir."""
    temp = "\n".join(
        f"    {kind}_temp_path {run_dir}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # Workers read the shards as the user who started the server (root included): the shard
    # directory is often private to that user, e.g. under pytest's tmp_path.
    user = "user root root;\n" if os.geteuid() == 0 else ""
    return f"""{user}daemon off;
worker_processes 2;
pid {run_dir}/nginx.pid;
error_log {run_dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
{temp}
    types {{ application/x-tar tar; application/json json; }}
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    server {{
        listen {host}:{port};
        root {root};
        location / {{ autoindex on; }}
    }}
}}
"""


def wait_ready(url: str, alive: Any, timeout_s: float, logs: Any) -> None:
    """Poll `url` until it answers 200; raise with the backend's logs if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if not alive():
            raise ServerError(f"shard server exited before answering {url}:\n{logs()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.1)
    raise ServerError(f"shard server did not answer {url} within {timeout_s:.0f} s ({last}):\n{logs()}")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        pass


class ShardServer:
    """A context manager that serves `root` read-only at `self.url` until exit."""

    def __init__(self, root: str | Path, *, backend: str = "auto", host: str = "127.0.0.1", port: int = 0, ready_timeout_s: float = 30.0):
        if backend not in BACKENDS:
            raise ServerError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ServerError(f"shard directory {self.root} does not exist; run `raywds convert` first")
        self.requested = backend
        self.host = host
        self.port = port
        self.ready_timeout_s = ready_timeout_s
        self.backend = ""
        self._stop: list[Any] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ShardServer:
        if self.requested != "auto":
            getattr(self, f"_start_{self.requested}")()
            self.backend = self.requested
            return self
        reasons = []
        for backend in ("docker", "nginx", "embedded"):
            try:
                getattr(self, f"_start_{backend}")()
                self.backend = backend
                return self
            except ServerError as e:
                self.close()
                reasons.append(f"{backend}: {e}")
        raise ServerError("no shard server backend started:\n" + "\n".join(reasons))

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self.close()

    def close(self) -> None:
        while self._stop:
            self._stop.pop()()

    def _run_dir(self) -> str:
        run_dir = tempfile.mkdtemp(prefix="raywds-nginx-")
        self._stop.append(functools.partial(shutil.rmtree, run_dir, ignore_errors=True))
        return run_dir

    def _start_nginx(self) -> None:
        binary = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
        if binary is None:
            raise ServerError("no nginx binary on PATH; install it (apt-get install nginx-light) or use --backend embedded")
        self.port = self.port or free_port(self.host)
        run_dir = self._run_dir()
        conf = Path(run_dir) / "nginx.conf"
        conf.write_text(nginx_conf(root=str(self.root), host=self.host, port=self.port, run_dir=run_dir))
        log = Path(run_dir) / "error.log"
        proc = subprocess.Popen(
            [binary, "-p", run_dir, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=open(log, "ab")  # noqa: SIM115
        )

        def stop() -> None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        self._stop.append(stop)
        wait_ready(self.url + "/", lambda: proc.poll() is None, self.ready_timeout_s, lambda: log.read_text(errors="replace")[-2000:])

    def _start_embedded(self) -> None:
        handler = functools.partial(_Quiet, directory=str(self.root))
        try:
            httpd = http.server.ThreadingHTTPServer((self.host, self.port), handler)
        except OSError as e:
            raise ServerError(f"embedded server cannot listen on {self.host}:{self.port}: {e}") from None
        httpd.daemon_threads = True
        self.port = int(httpd.server_address[1])
        thread = threading.Thread(target=httpd.serve_forever, name="raywds-shard-server", daemon=True)
        thread.start()

        def stop() -> None:
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=10)

        self._stop.append(stop)
        wait_ready(self.url + "/", thread.is_alive, self.ready_timeout_s, lambda: "(embedded server)")

    def _start_docker(self) -> None:
        try:
            import docker
            import docker.errors

            client = docker.from_env()
            client.ping()
        except Exception as e:  # noqa: BLE001 - any failure to reach an engine means "no docker"
            raise ServerError(f"no Docker engine answers ({type(e).__name__}: {e})") from None
        self.port = self.port or free_port(self.host)
        run_dir = self._run_dir()
        Path(run_dir, "nginx.conf").write_text(
            nginx_conf(root="/usr/share/nginx/html", host=self.host, port=self.port, run_dir="/tmp")
        )
        try:
            container = client.containers.run(
                DOCKER_IMAGE,
                command=["nginx", "-c", "/etc/raywds/nginx.conf"],
                detach=True,
                auto_remove=False,
                network_mode="host",
                volumes={
                    str(self.root): {"bind": "/usr/share/nginx/html", "mode": "ro"},
                    run_dir: {"bind": "/etc/raywds", "mode": "ro"},
                },
                labels={"raywds": "shard-server"},
            )
        except docker.errors.DockerException as e:
            raise ServerError(f"cannot start the {DOCKER_IMAGE} container: {e}") from None

        def stop() -> None:
            try:
                container.remove(force=True)
            except docker.errors.DockerException:
                pass

        self._stop.append(stop)

        def alive() -> bool:
            container.reload()
            return bool(container.status in ("created", "running"))

        wait_ready(self.url + "/", alive, self.ready_timeout_s, lambda: container.logs(tail=50).decode(errors="replace"))
